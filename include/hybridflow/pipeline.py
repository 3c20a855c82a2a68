"""The training pipeline's steps: what each Airflow task does, between the trigger form and the
domain modules. Every step takes plain JSON (Params and upstream XCom) and returns plain JSON
references; data stays in storage.

Re-running any step is safe: outputs are keyed by the run (``RunIdentity.run_key``) and by content,
so a cleared task re-attaches to, or overwrites, what its earlier try made.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from hybridflow.runs import RunIdentity, run_dir, write_json_atomic
from hybridflow.settings import Settings, get_settings

log = logging.getLogger(__name__)


def _estate(settings: Settings):
    from hybridflow.config import load_estate

    return load_estate(settings.config_dir)


def _admitted(run: Mapping[str, Any]):
    from hybridflow.request import AdmittedRun

    return AdmittedRun.from_xcom(dict(run))


def admit(params: Mapping[str, Any], identity: RunIdentity, settings: Settings | None = None) -> dict:
    from hybridflow.admission import admit as admit_request
    from hybridflow.backends import estate_load, team_usage

    settings = settings or get_settings()
    estate = _estate(settings)
    held = team_usage(estate_load(estate, settings.state_dir))  # GPUs each team's gangs hold now
    admitted = admit_request(params, estate, settings.private_root, team_usage=held,
                             file_roots=estate.file_roots(settings.home))
    log.info("Admitted run %s: model %s on dataset %s (%s%s) for project %s: %s", identity.run_key, admitted.model,
             admitted.dataset, admitted.classification,
             f", regions {', '.join(admitted.regions)}" if admitted.regions else "", admitted.project,
             admitted.to_xcom())
    return {**admitted.to_xcom(), "run_key": identity.run_key}


def _entries(run: Mapping[str, Any], estate):
    """(admitted run, its dataset's catalogue entry, its model's registry entry)."""
    admitted = _admitted(run)
    return admitted, estate.datasets.get(admitted.dataset), estate.models.get(admitted.model)


def validate_data(run: Mapping[str, Any], settings: Settings | None = None) -> dict:
    """The dataset's schema and expectation suites where the data lives; pins the version checked."""
    from hybridflow import rundata

    settings = settings or get_settings()
    estate = _estate(settings)
    admitted, entry, _ = _entries(run, estate)
    return rundata.validate(entry, admitted.classification, run["run_key"], private_root=settings.private_root,
                            file_roots=estate.file_roots(settings.home), log=log)


def choose_cluster(run: Mapping[str, Any], settings: Settings | None = None) -> dict:
    """Place the run. A run the takeover holds (a cluster down would take it, or batch work paused)
    waits in this step: rescheduled every ``training.gang_admission_timeout_s`` (no worker slot held
    meanwhile) for at most ``training.max_queue_wait_s``, then refused (:func:`_hold`)."""
    from hybridflow.placement.decide import decide
    from hybridflow.placement.takeover import PlacementHeld

    settings = settings or get_settings()
    started = time.monotonic()
    estate = _estate(settings)
    admitted = _admitted(run)
    try:
        decision = decide(admitted, estate, settings)
    except PlacementHeld as held:
        _hold(run, held, estate, settings)
    _end_hold(run, settings)
    log.info("Placement decision:\n%s", decision.explain())
    out = {**decision.to_xcom(), "seconds": round(time.monotonic() - started, 3)}
    # For the run's page in the UI (hybridflow.ui.runs); a re-run replaces it.
    write_json_atomic(run_dir(settings.private_root, run["run_key"]) / "placement.json", out)
    return out


def _hold(run: Mapping[str, Any], held: Any, estate, settings: Settings) -> NoReturn:
    """Reschedule the placement step while the run is held, noting since when on the run's page
    (queue.json); past ``training.max_queue_wait_s`` the held error stands, naming the limit."""
    from datetime import UTC, datetime, timedelta

    from hybridflow.errors import PlacementError
    from hybridflow.queueing import QUEUE_FILE, read_standing

    cfg = estate.pipeline.training
    note = read_standing(settings.private_root, run["run_key"]) or {}
    now = time.time()
    since = float(note["held_since_s"]) if note.get("held") else now
    waited = now - since
    path = run_dir(settings.private_root, run["run_key"]) / QUEUE_FILE
    if waited >= cfg.max_queue_wait_s:
        path.unlink(missing_ok=True)  # a cleared task waits afresh
        raise PlacementError(
            f"held {waited:.0f} s, training.max_queue_wait_s is {cfg.max_queue_wait_s} (config/pipeline.yaml): "
            f"{held}\nClear the choose_cluster task to wait again once the clusters are back, or raise the limit")
    again = min(float(cfg.gang_admission_timeout_s), cfg.max_queue_wait_s - waited)
    at = datetime.fromtimestamp(now, UTC)
    write_json_atomic(path, {
        "cluster": ", ".join(held.waits_for), "state": f"held: {held.state}", "held": held.reason,
        "held_since_s": since, "queued_since": datetime.fromtimestamp(since, UTC).isoformat(timespec="seconds"),
        "waited_s": round(waited, 1), "updated_at": at.isoformat(timespec="seconds"),
        "next_check": (at + timedelta(seconds=again)).isoformat(timespec="seconds")})
    log.warning("Placement holds the run (%s), %.0f s of at most %d s: %s. Placement tries again in %.0f s",
                held.state, waited, cfg.max_queue_wait_s, held.reason, again)
    from airflow.sdk.exceptions import AirflowRescheduleException

    raise AirflowRescheduleException(at + timedelta(seconds=again))


def _end_hold(run: Mapping[str, Any], settings: Settings) -> None:
    """A run placed after a hold: the hold's note leaves its page."""
    from hybridflow.queueing import QUEUE_FILE, read_standing

    if (read_standing(settings.private_root, run["run_key"]) or {}).get("held"):
        (run_dir(settings.private_root, run["run_key"]) / QUEUE_FILE).unlink(missing_ok=True)


def stage_data(run: Mapping[str, Any], placement: Mapping[str, Any], settings: Settings | None = None) -> dict:
    """Private local cluster: train where the data lives. Public or Kubernetes cluster: copy it to the
    cluster's cache (:func:`hybridflow.placement.stage.stage_data`)."""
    from hybridflow.placement.stage import stage_data as stage

    return stage(run, placement, settings or get_settings())


def _holdout(run: Mapping[str, Any], estate, settings: Settings):
    """The held-out split of the run's validated dataset, read verified where it lives."""
    from hybridflow import rundata

    admitted, entry, model = _entries(run, estate)
    dataset = rundata.open_validated(entry, run["run_key"], admitted.classification, private_root=settings.private_root,
                                     file_roots=estate.file_roots(settings.home))
    return dataset.split(entry.holdout).frame(), entry, model


def evaluate(run: Mapping[str, Any], trained: Mapping[str, Any], settings: Settings | None = None) -> dict:
    """The model's metric on the held-out split; on the wrong side of its gate the run stops."""
    from hybridflow.errors import HybridFlowError
    from hybridflow.evaluation import evaluate_bundle

    settings = settings or get_settings()
    estate = _estate(settings)
    started = time.monotonic()
    frame, entry, model = _holdout(run, estate, settings)
    report = evaluate_bundle(Path(trained["bundle"]), frame)
    metric = report["metric"]
    out = run_dir(settings.private_root, run["run_key"]) / "evaluation.json"
    write_json_atomic(out, report)
    log.info("Held-out %s of %s: %.4f on %d rows of %s/%s (gate %s %g)", metric["name"], model.name, metric["value"],
             report["n"], entry.name, entry.holdout, "at least" if metric["direction"] == "higher" else "at most",
             metric["gate"])
    if not metric["passed"]:
        raise HybridFlowError(
            f"model {model.name}: {metric['name']} {metric['value']:.4f} on the held-out split is "
            f"{'below' if metric['direction'] == 'higher' else 'above'} its gate {metric['gate']} (models.yaml "
            f"models.{model.name}.metric.gate); train longer or tune its hyperparameters, or check the data, then "
            "clear the train task"
        )
    return {"metric": metric, "n": report["n"], "report_path": str(out),
            "seconds": round(time.monotonic() - started, 3)}


def compress(run: Mapping[str, Any], trained: Mapping[str, Any], settings: Settings | None = None) -> dict:
    """int8 and fp16 variants, each kept only if the model's metric drops at most its max_drop."""
    from hybridflow.compression import compress_bundle

    settings = settings or get_settings()
    estate = _estate(settings)
    admitted = _admitted(run)
    started = time.monotonic()
    frame, _, _ = _holdout(run, estate, settings)
    report = compress_bundle(Path(trained["bundle"]), frame, run_dir(settings.private_root, run["run_key"]) / "compressed",
                             mode=admitted.compression)
    return {**report, "seconds": round(time.monotonic() - started, 3)}


def deploy(run: Mapping[str, Any], compressed: Mapping[str, Any], settings: Settings | None = None) -> dict:
    """Serve the compressed model behind the model's endpoint on the estate's deploy target
    (``serving.target``): locally the smoke test scores the held-out split through the new version's
    server against the model's gate, and the load-test gate (``serving.gate``) compares it with the
    serving version, before any traffic moves; traffic then moves in ``serving.canary.steps``, each
    step judged, rolled back on a failure. On Kubernetes the canary's readiness probe is the gate.
    What the deploy measured and did goes to the run's ``deploy.json`` whether it succeeded or not."""
    from hybridflow.bundle import read_card
    from hybridflow.errors import DeploymentError
    from hybridflow.serving import deploy_target
    from hybridflow.serving.base import DeployRequest, roll

    settings = settings or get_settings()
    admitted = _admitted(run)
    if not admitted.deploy:
        log.info("deploy=false: the compressed model is kept in %s, not served", compressed["bundle"])
        return {"deployed": False}
    estate = _estate(settings)
    model = estate.models.get(admitted.model)
    bundle = Path(compressed["bundle"])
    card = read_card(bundle)

    def smoke():  # read only by targets that smoke-test through the server
        frame, _, _ = _holdout(run, estate, settings)
        return frame[card.input_names].to_numpy(dtype="float32"), frame[card.target].to_numpy()

    target = deploy_target(estate, model.endpoint, state_dir=settings.state_dir, log=log)
    started = time.monotonic()
    outcome_path = run_dir(settings.private_root, run["run_key"]) / "deploy.json"
    try:
        result = roll(target, DeployRequest(run["run_key"], bundle, variant=compressed["selected"],
                                            metric=card.metric, smoke=smoke))
    except DeploymentError as exc:  # recorded for the run's page; the error stands
        outcome = exc.outcome or {"endpoint": model.endpoint, "version": run["run_key"], "target": target.name,
                                  "status": "rolled_back",
                                  "rolled_back": {"step": None, "reason": str(exc), "serving": None}}
        write_json_atomic(outcome_path, {**outcome, "error": str(exc)})
        raise
    write_json_atomic(outcome_path, result)
    return {**result, "deployed": True, "seconds": round(time.monotonic() - started, 3)}


def record(
    run: Mapping[str, Any],
    identity: RunIdentity,
    steps: Mapping[str, Mapping[str, Any] | None],
    settings: Settings | None = None,
) -> dict:
    """Write the run record later cost work reads. Keyed by the run: re-running replaces it."""
    from hybridflow.records import build_record, write_record

    settings = settings or get_settings()
    rec = build_record(_admitted(run), identity, steps)
    path = write_record(settings.private_root, rec)
    log.info("Run record written to %s", path)
    from hybridflow.ledger import ingest_run_record

    # Into the ledger too (replacing this run's rows), where the nightly cost allocation reads attempts.
    log.info("Ledger: %d training attempts of %s stored", ingest_run_record(rec), rec["run_key"])
    return {"record_path": str(path), **{k: rec[k] for k in ("cluster", "gpu_hours", "workers")}}
