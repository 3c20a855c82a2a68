"""A disaster-recovery drill: a minimum-scale takeover end to end, measured, then failback.

Four steps, each safe to clear and run again (the report in private storage carries what the
earlier ones did, :mod:`hybridflow.dr.drills.report`):

1. :func:`declare` — the primary's newest committed checkpoint step is noted (the recovery point to
   measure against), then the primary is declared down through the fence
   (:func:`hybridflow.dr.fencing.drain.fence_and_drain`): no new placements there and its gangs
   checkpointed and stopped before anything starts on the DR side, so two sides never write at
   once. A primary already down for another reason (a real outage) is refused: a drill must not
   fail it back.
2. :func:`take_over` — on the DR cluster, from the DR store only: the critical endpoint served from
   the replicated model and answering, and the critical run resumed from its replicated checkpoint
   and stepping (:mod:`hybridflow.dr.drills.takeover`); both are then stopped.
3. :func:`fail_back` — nothing of the drill left running on the DR side (its server, its endpoint on
   the DR inference pool and its gang stopped, found by what the report recorded and by the gang's
   name), and the primary declared up whenever the fence is the drill's, also after a declaration
   that failed half way (its drain raised), with serving moved back by the failback's gate.
4. :func:`finish` — RTO and RPO against the targets, kept in the report and the ledger
   (:mod:`hybridflow.dr.drills.ledger`); a miss fails, naming the step.

A DR cluster with ``backend: kubernetes``: the resumed run is a gang job on that cluster (its
training node pool, the queue of the team of the model's project), its pods reading the data and
writing checkpoints in the DR store; its name derives from the drill, so fail_back deletes it even
after a task restart. Where the endpoint is served depends on ``serving.target``:

- ``kubernetes`` or ``kserve``: on the DR cluster's inference pool (``clusters.<dr>.dr.serving``,
  :func:`hybridflow.dr.failover.serving_k8s.start_on_dr`), healthy once its check passed (a prediction at the
  InferenceService's URL; for kind deployment every replica ready, its Service being in-cluster);
  the drill removes what it started there. An endpoint the declaration's serving failover moved to
  that pool already is measured as it stands and moved back by declare_up's failback;
- ``local``: the model server on this machine, as for a local DR cluster: the model gateway that
  would route to it runs here, not on the cluster.

RTO is measured the same way on every backend: declared -> inference healthy, declared -> training
stepping (a checkpoint committed beyond the replicated one).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from hybridflow.dr.drills.report import DrillError, DrillMissed, Targets, judge, read_report, update_report
from hybridflow.dr.replication.replicas import logger

REASON_PREFIX = "dr drill"


@dataclass(frozen=True)
class Plan:
    """A drill's input, checked against the estate before anything is done."""

    drill: str
    primary: str
    dr: Any  # the DR cluster
    dr_spec: Any  # its store
    targets: Targets
    endpoint: str | None = None
    run_key: str | None = None
    workers: int = 1
    extra_steps: int = 20

    @property
    def reason(self) -> str:
        return f"{REASON_PREFIX} {self.drill}: minimum-scale takeover by the dr_drill DAG, failed back when done"


def make_plan(estate, drill: str, params: Mapping[str, Any], *, dr_spec: Any = None) -> Plan:
    """The drill ``params`` ask for; DrillError naming the Param when they cannot be right."""
    from hybridflow.dr.replication.scope import ReplicationError, dr_cluster
    from hybridflow.fencing import FencingError, check_down

    try:
        dr = dr_cluster(estate, params.get("dr_cluster") or None)
    except ReplicationError as exc:
        raise DrillError("dr_cluster", str(exc).split(": ", 1)[-1]) from None
    primary = params.get("primary") or _only_primary(estate)
    try:
        check_down(estate, primary, REASON_PREFIX)
    except FencingError as exc:
        raise DrillError("primary", str(exc)) from None
    if estate.clusters[primary].role != "primary":
        raise DrillError("primary", f"{primary} has role {estate.clusters[primary].role}: a drill takes over from a "
                                    f"primary; name one with role primary ({', '.join(_primaries(estate)) or 'none'})")
    if dr_spec is None:
        from hybridflow.dr.replication.readiness import check_readiness
        from hybridflow.placement.places import cache_store_spec

        missing = check_readiness(dr, estate)
        if missing:
            raise DrillError(missing[0].field, f"{missing[0].what}; {missing[0].fix}")
        dr_spec = cache_store_spec(dr)
    workers = int(params.get("workers") or 1)
    if workers < 1 or workers > dr.total_gpus:
        raise DrillError("workers", f"{workers}: the DR cluster {dr.name} has {dr.total_gpus} GPUs; use 1..{dr.total_gpus}")
    if dr.runs_pods:
        from hybridflow.dr.drills.takeover import check_dr_pool, serves_on_dr_pool, training_pool

        training_pool(dr, workers)  # a gang runs on one node pool: one must hold it
        if serves_on_dr_pool(estate, dr):
            check_dr_pool(estate, dr)
    return Plan(drill=drill, primary=primary, dr=dr, dr_spec=dr_spec, targets=Targets.from_params(params),
                endpoint=params.get("endpoint") or None, run_key=params.get("run_key") or None, workers=workers,
                extra_steps=int(params.get("extra_steps") or 20))


def _primaries(estate) -> list[str]:
    return sorted(n for n, c in estate.clusters.items() if c.role == "primary")


def _only_primary(estate) -> str:
    primaries = _primaries(estate)
    if len(primaries) != 1:
        raise DrillError("primary", f"name the primary to declare down (role primary in clusters.yaml: "
                                    f"{', '.join(primaries) or 'none'})")
    return primaries[0]


def _primary_steps(estate, settings, primary: str, run_key: str) -> tuple[list[int], str]:
    """The committed checkpoint steps of ``run_key`` in the primary's checkpoint places, and a note
    of each place that could not be read."""
    from hybridflow.placement.places import checkpoint_replica_spec, checkpoint_store_spec
    from hybridflow.storage.objectstore import open_store
    from hybridflow.training.checkpoint import CheckpointStore

    cluster = estate.clusters[primary]
    steps, notes = [], []
    for spec in (checkpoint_store_spec(run_key, cluster, settings), checkpoint_replica_spec(run_key, cluster, settings)):
        try:
            steps += CheckpointStore(open_store(spec)).committed_steps()
        except Exception as exc:  # noqa: BLE001 - a primary in trouble may not answer: noted
            notes.append(f"{spec.uri}: {type(exc).__name__}: {exc}")
    return steps, "; ".join(notes)


def _interval(primary_steps: list[int], plan: Plan) -> int:
    """One checkpoint interval of the run: the target's rpo_steps, else the gap between the
    primary's two newest committed checkpoints, else the trigger form's default checkpoint_every_steps."""
    if plan.targets.rpo_steps is not None:
        return plan.targets.rpo_steps
    steps = sorted(set(primary_steps))
    if len(steps) >= 2:
        return steps[-1] - steps[-2]
    from hybridflow.params import PARAM_DEFAULTS

    return int(PARAM_DEFAULTS["checkpoint_every_steps"])


def declare(plan: Plan, estate, settings, *, by: str | None = None) -> dict[str, Any]:
    """Step 1: note the recovery point, then fence the primary (see the module doc)."""
    from hybridflow.dr.drills.replicas import choose_run
    from hybridflow.dr.fencing.drain import fence_and_drain
    from hybridflow.fencing import down_clusters, state_path
    from hybridflow.storage.objectstore import open_store

    report = read_report(settings.private_root, plan.drill)
    standing = down_clusters(state_path(settings.state_dir)).get(plan.primary)
    if standing is not None and not _fenced_by(plan, standing):
        raise DrillError("primary", f"{plan.primary} is declared down already ({standing.get('reason')}, by "
                                    f"{standing.get('by')}): a drill would fail it back; drill when it is up")
    if standing is not None and report.get("declared_ts"):
        return report  # this step ran already: the first declaration is the one measured
    if "primary_step" not in report:  # noted once, before the fence stops the primary's gangs
        run_key = choose_run(open_store(plan.dr_spec), plan.run_key)
        steps, note = _primary_steps(estate, settings, plan.primary, run_key)
        report = update_report(
            settings.private_root, plan.drill, primary=plan.primary, dr_cluster=plan.dr.name, run_key=run_key,
            primary_step=max(steps) if steps else None, primary_note=note, targets=plan.targets.to_dict(),
            checkpoint_interval_steps=_interval(steps, plan), status="declaring")
    # The report exists before the fence is written: a declaration that fails half way (its drain
    # raised) is still failed back by fail_back, which lifts any fence carrying this drill's reason.
    try:
        out = fence_and_drain(plan.primary, plan.reason, by=by or "dr_drill", estate=estate,
                              state_dir=settings.state_dir, dr_spec=plan.dr_spec)
    except Exception as exc:
        update_report(settings.private_root, plan.drill, status="declare failed",
                      declare_error=f"{type(exc).__name__}: {exc}")
        raise
    declared = time.time()
    logger.info("drill %s: %s declared down at %s; the primary's newest checkpoint of %s is step %s", plan.drill,
                plan.primary, out["record"].get("declared_at"), report["run_key"], report["primary_step"])
    return update_report(
        settings.private_root, plan.drill, declared_ts=declared,
        declared_at=datetime.fromtimestamp(declared, UTC).isoformat(timespec="seconds"), declared_by_drill=True,
        fence=out["record"], status="declared", declare_error=None)


def _fenced_by(plan: Plan, record: Mapping[str, Any]) -> bool:
    """Whether the fence ``record`` is this drill's (its reason names the drill)."""
    return str(record.get("reason", "")).startswith(plan.reason)


def take_over(plan: Plan, estate, settings) -> dict[str, Any]:
    """Step 2: serve and train on the DR cluster from the DR store, check both, stop both."""
    from hybridflow.dr.drills.replicas import choose_endpoint, newest_dataset
    from hybridflow.dr.drills.takeover import start_training, wait_stepping
    from hybridflow.placement.places import scratch_root
    from hybridflow.storage.objectstore import open_store

    report = read_report(settings.private_root, plan.drill)
    if not report.get("declared_ts"):
        raise DrillError("declare_down", f"drill {plan.drill} has not declared {plan.primary} down; run "
                                         "declare_down first")
    store = open_store(plan.dr_spec)
    endpoint = choose_endpoint(store, plan.endpoint)
    _stop_server(report.get("server_pid"))  # an earlier try's server whose task died: never two
    # What the drill fetches lands on this machine: on Kubernetes scratch_dir is the pods' mount.
    scratch = (scratch_root(plan.dr, settings) if plan.dr.on_this_machine
               else settings.home / "scratch" / plan.dr.name) / "drills" / plan.drill
    gang = server = pool = None
    # An earlier try's figures are cleared: only what this try measures is judged.
    parts: dict[str, Any] = {"status": "taking over", "takeover_started_ts": time.time(), "inference": None,
                             "training": None, "dataset": None, "error": None}
    try:
        gang, parts["training"] = start_training(
            estate, settings, plan.dr, plan.dr_spec, report["run_key"], plan.drill,
            f"t{int(parts['takeover_started_ts'] * 1000)}", workers=plan.workers, extra_steps=plan.extra_steps,
            window_s=plan.targets.training_rto_s * 2)
        update_report(settings.private_root, plan.drill, **parts)
        server, pool, parts["inference"] = _serve(plan, estate, settings, endpoint, scratch)
        step, when = wait_stepping(gang, timeout_s=plan.targets.training_rto_s * 2)
        parts["training"].update(stepping_step=step, stepping_ts=when)
        data = newest_dataset(plan.dr_spec, estate.models.get(parts["training"]["model"]).dataset)
        parts["dataset"] = None if data is None else {"dataset": data.dataset, "manifest_key": data.manifest_key,
                                                      "created_at": data.created_at, "age_s": data.age_s}
        parts["status"] = "taken over" if step is not None else "training did not step"
    except DrillError:
        raise
    except Exception as exc:
        parts["status"] = "failed"
        parts["error"] = f"{type(exc).__name__}: {exc}"
        logger.exception("drill %s: the takeover failed", plan.drill)
    finally:
        if server is not None:
            server.server_close()
        if pool is not None:
            stopped = _stop_on_pool(plan, estate, pool)
            if parts.get("inference"):
                parts["inference"]["stopped"] = stopped
        if gang is not None:
            gang.stop()
            if parts.get("training"):
                parts["training"]["gang_outcome"] = dict(gang.outcome)
        update_report(settings.private_root, plan.drill, **parts)
    return read_report(settings.private_root, plan.drill)


def _serve(plan: Plan, estate, settings, endpoint: str, scratch) -> tuple[Any, str | None, dict[str, Any]]:
    """(the model server started here or None, the endpoint the drill serves on the DR pool and must
    stop or None, what was measured). On the DR pool the endpoint is noted in the report before it
    starts, so fail_back stops it after a task death; one the serving failover of the declaration
    serves already is measured as it stands and left to the failback of declare_up."""
    from hybridflow.dr.drills.takeover import serves_on_dr_pool, start_inference, start_inference_on_pool

    if not serves_on_dr_pool(estate, plan.dr):
        server, measured = start_inference(plan.dr_spec, endpoint, scratch,
                                           lambda pid: update_report(settings.private_root, plan.drill, server_pid=pid))
        return server, None, measured
    ours = not _failover_serves(settings, endpoint)
    if ours:
        update_report(settings.private_root, plan.drill, dr_serving={"endpoint": endpoint, "cluster": plan.dr.name})
    measured = start_inference_on_pool(estate, plan.dr, plan.dr_spec, endpoint, scratch)
    return None, endpoint if ours else None, {**measured, "served_by": "drill" if ours else "serving failover"}


def _failover_serves(settings, endpoint: str) -> bool:
    from hybridflow.dr.failover.serving_k8s import record_path

    return record_path(settings.state_dir, endpoint).is_file()


def _stop_on_pool(plan: Plan, estate, endpoint: str) -> bool | str:
    """Remove the drill's endpoint from the DR pool: whether it was there, or why it could not be
    (fail_back tries again)."""
    from hybridflow.dr.failover.serving_k8s import stop_on_dr

    try:
        return stop_on_dr(estate, plan.dr, endpoint)
    except Exception as exc:  # noqa: BLE001 - the takeover's outcome is kept; fail_back retries the stop
        logger.exception("drill %s: could not remove %s from the DR pool of %s", plan.drill, endpoint, plan.dr.name)
        return f"{type(exc).__name__}: {exc}"


def _stop_server(pid: int | None) -> bool:
    """End the drill's model server by the pid the report recorded, if that process is still it."""
    if not pid:
        return False
    try:
        cmdline = open(f"/proc/{int(pid)}/cmdline", "rb").read().decode(errors="replace")
    except OSError:
        return False
    if "hybridflow.serving.server" not in cmdline:
        return False  # the pid was reused by another process: not ours
    import signal

    os.kill(int(pid), signal.SIGTERM)
    for _ in range(100):
        if not os.path.exists(f"/proc/{int(pid)}"):
            break
        time.sleep(0.1)
    return True


def fail_back(plan: Plan, estate, settings, *, by: str | None = None) -> dict[str, Any]:
    """Step 3: nothing of the drill running on the DR side, and the primary up (if the drill put
    it down). Safe to run any number of times, also after a failed take_over."""
    from hybridflow.backends import gang_backend
    from hybridflow.dr.drills.takeover import gang_name
    from hybridflow.dr.fencing.failback import declare_up
    from hybridflow.fencing import down_clusters, serving_stayed, state_path

    report = read_report(settings.private_root, plan.drill)
    backend = gang_backend(plan.dr, estate, settings.state_dir)
    name = gang_name(plan.drill, backend)
    stopped_gang = backend.cancel(name)
    stopped_server = _stop_server(report.get("server_pid"))
    for _ in range(300):  # the gang's workers commit their last checkpoint, then leave
        if name not in backend.find_gangs({}):
            break
        time.sleep(0.1)
    still = [g for g in backend.find_gangs({}) if g == name]
    serving = report.get("dr_serving") or {}
    stopped_pool = None  # the endpoint the drill served on the DR pool (a failover's stays: declare_up moves it)
    if serving.get("endpoint") and not _failover_serves(settings, serving["endpoint"]):
        stopped_pool = _stop_on_pool(plan, estate, serving["endpoint"])
    up = stayed = None
    standing = down_clusters(state_path(settings.state_dir)).get(plan.primary)
    if report.get("declared_by_drill") or (standing is not None and _fenced_by(plan, standing)):
        change = declare_up(plan.primary, by=by or "dr_drill", estate=estate, path=state_path(settings.state_dir))
        up, stayed = change.to_dict(), serving_stayed(change)
    failback = {"primary_up": up, "stopped_gang": stopped_gang, "stopped_server": stopped_server,
                "stopped_dr_serving": stopped_pool, "dr_still_running": still}
    # A drill that never declared the primary down keeps no report (nothing was measured).
    out = update_report(settings.private_root, plan.drill, failed_back_ts=time.time(), failback=failback) \
        if report else {"drill": plan.drill, "failback": failback}
    if still:
        raise DrillError("fail_back", f"gang {name} still runs on {plan.dr.name}; clear fail_back to stop it")
    if isinstance(stopped_pool, str):
        raise DrillError("fail_back", f"{serving['endpoint']} could not be removed from the inference pool of "
                                      f"{plan.dr.name} ({stopped_pool}); clear fail_back to try again")
    if stayed:  # the declaration's serving failover is not undone until the primary passes the gate
        raise DrillError("fail_back", f"{plan.primary} is up, but serving stays on {plan.dr.name}: "
                                      f"{'; '.join(stayed)}; clear fail_back to retry the serving failback")
    return out


def finish(plan: Plan, estate, settings) -> dict[str, Any]:
    """Step 4: the figures and the verdict into the report; DrillMissed naming each missed step.
    A drill that never declared the primary down measured nothing and keeps no report."""
    report = read_report(settings.private_root, plan.drill)
    if not report.get("declared_ts"):
        why = f" ({report['declare_error']})" if report.get("declare_error") else ""
        raise DrillError("declare_down", f"drill {plan.drill} did not declare {plan.primary} down{why}, so nothing "
                                         "was measured; see the declare_down task's log")
    figures, missed = judge(report)
    if report.get("error"):
        missed.insert(0, f"take_over failed: {report['error']}")
    verdict = "met" if not missed else "missed"
    report = update_report(settings.private_root, plan.drill, figures=figures, missed=missed, verdict=verdict,
                           status="done")
    from hybridflow.dr.drills.ledger import record_drill

    record_drill(report)  # into the ledger too, replacing this drill's row
    if missed:
        raise DrillMissed(f"drill {plan.drill} missed its targets:\n" + "\n".join(f"  - {m}" for m in missed))
    return report
