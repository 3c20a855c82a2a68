"""The takeover a drill performs on the DR cluster: the critical endpoint served from the replicated
model, and a small training run resumed from the replicated checkpoint, each checked.

- **inference**: the newest replicated version is fetched (verified) from the DR store onto the DR
  cluster's scratch, started with the project's model server, and is healthy once it answers a
  prediction (one instance made from the model's signature);
- **training**: the replicated checkpoint is copied, verified, inside the DR store to the drill's own
  checkpoint place (``drills/<drill>/checkpoints``: the replicated sets stay add-only), and a gang
  of the run's registered model starts on the DR cluster's backend reading the replicated dataset
  version; it is stepping once it commits a checkpoint beyond the one it resumed from.

Every time is ``time.time()``, compared with the declaration's.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hybridflow.dr.drill_report import DrillError
from hybridflow.storage.objectstore import StoreSpec, open_store
from hybridflow.training.checkpoint import CheckpointStore

GANG_PREFIX = "drill-"
log = logging.getLogger("hybridflow.dr")


def gang_name(drill: str) -> str:
    return f"{GANG_PREFIX}{drill}"[:120]


def probe_instance(signature: dict[str, Any]) -> list[Any]:
    """One valid instance of the signature: each column at its minimum (0 where it has none)."""
    from hybridflow.serving.schema import InputSchema

    row: list[Any] = []
    for _name, kind, lo, hi in InputSchema(signature).columns:
        if kind == "bool":
            row.append(False)
            continue
        value = lo if lo is not None else (min(0.0, hi) if hi is not None else 0.0)
        row.append(int(value) if kind == "int" else float(value))
    return row


def predict_once(base: str, endpoint: str, row: list[Any], timeout_s: float = 10) -> dict[str, Any]:
    body = json.dumps({"instances": [row]}).encode()
    req = urllib.request.Request(f"{base}/v1/models/{endpoint}:predict", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - loopback URL we built
        answer = json.loads(resp.read())
    if not answer.get("predictions"):
        raise DrillError("endpoint", f"{endpoint} answered without predictions: {answer}")
    return answer


def start_inference(spec: StoreSpec, endpoint: str, scratch: Path, on_started: Callable[[int], None],
                    start_timeout_s: float = 120) -> tuple[Any, dict[str, Any]]:
    """(the running server, what was measured): serving the replicated model and answering."""
    from hybridflow.bundle import read_card
    from hybridflow.dr.drill_replicas import fetch_model
    from hybridflow.serving.server import ServerProcess

    model = fetch_model(spec, endpoint, scratch / "models")
    fetched = time.time()
    server = ServerProcess(model.bundle, endpoint, model.version, 0, start_timeout_s=start_timeout_s)
    on_started(server.proc.pid)
    try:
        host, port = server.server_address
        answer = predict_once(f"http://{host}:{port}", endpoint, probe_instance(read_card(model.bundle).signature))
    except BaseException:
        server.server_close()
        raise
    return server, {"endpoint": endpoint, "model": model.model, "version": model.version,
                    "replicated_at": model.replicated_at, "fetched_ts": fetched, "healthy_ts": time.time(),
                    "prediction": answer["predictions"][0], "pid": server.proc.pid}


def seed_checkpoint(spec: StoreSpec, run_key: str, place_name: str) -> tuple[Any, StoreSpec]:
    """(the replicated checkpoint, the drill's checkpoint place ``drills/<place_name>/checkpoints``
    holding a verified copy of it)."""
    from hybridflow.dr.drill_replicas import replicated_checkpoint

    checkpoint = replicated_checkpoint(spec, run_key)
    place = spec.child(f"drills/{place_name}/checkpoints")
    target = CheckpointStore(open_store(place))
    if checkpoint.step not in target.committed_steps():  # a rerun finds it there already
        target.save(checkpoint.step, checkpoint.shards, dict(checkpoint.meta))
    return checkpoint, place


@dataclass
class TrainingGang:
    """The drill's gang running in a thread of this task (the local backend supervises it here)."""

    backend: Any
    name: str
    place: StoreSpec
    resumed_step: int
    thread: threading.Thread
    outcome: dict

    def stepped_beyond(self) -> int | None:
        steps = [s for s in CheckpointStore(open_store(self.place)).committed_steps() if s > self.resumed_step]
        return max(steps) if steps else None

    def stop(self, timeout_s: float = 60) -> None:
        self.backend.cancel(self.name)
        self.thread.join(timeout_s)


def _dataset_info(estate, data) -> dict[str, Any]:
    from hybridflow.datasets import split_files
    from hybridflow.rundata import dataset_info

    entry = estate.datasets.get(data.dataset)
    version = data.manifest_key.rsplit("/", 1)[1].removesuffix(".json")
    pinned = SimpleNamespace(splits=split_files(entry, [(p, 0) for p in data.paths]), version=version)
    return dataset_info(entry, pinned, entry.effective_classification)


def start_training(estate, settings, dr, spec: StoreSpec, run_key: str, drill: str, attempt: str, *,
                   workers: int = 1, extra_steps: int = 20) -> tuple[TrainingGang, dict[str, Any]]:
    """Resume ``run_key`` from its replicated checkpoint on ``dr`` for ``extra_steps`` more steps.
    Each ``attempt`` of the step gets a checkpoint place of its own, so a rerun resumes from the
    replicated checkpoint again, never from what an earlier try trained."""
    from hybridflow.backends import gang_backend
    from hybridflow.backends.base import GangJob
    from hybridflow.dr.drill_replicas import newest_dataset

    checkpoint, place = seed_checkpoint(spec, run_key, f"{drill}/{attempt}")
    model_name = checkpoint.meta.get("model")
    if model_name not in estate.models.models:
        raise DrillError("run_key", f"the replicated checkpoint of {run_key} names model {model_name!r}, which is "
                                    "not in models.yaml")
    model = estate.models.get(model_name)
    data = newest_dataset(spec, model.dataset)
    if data is None:
        raise DrillError("run_key", f"no version of dataset {model.dataset} (model {model.name}) is replicated to "
                                    "the DR store; run dr_replication")
    hparams = dict(model.defaults())
    if "steps" in hparams:  # a small run: a few steps beyond the resume point
        hparams["steps"] = checkpoint.step + extra_steps
    every = max(1, extra_steps // 4)
    job_spec = {
        "run_key": f"{run_key}-{drill}", "attempt": "drill",
        "model": {"name": model.name, "entrypoint": model.entrypoint, "hyperparameters": hparams},
        "dataset": _dataset_info(estate, data),
        "data": {"kind": "manifest", "store": spec.to_dict(), "manifest_key": data.manifest_key},
        "checkpoint_store": place.to_dict(), "checkpoint_every_steps": every, "keep": 3,
        "preemption_grace_s": estate.pipeline.training.preemption_grace_s, "log_every_steps": every,
    }
    backend = gang_backend(dr, estate, settings.state_dir)
    name = gang_name(drill)
    backend.cancel(name)  # an earlier try's gang whose task died: never two of the drill's gangs
    job = GangJob(name=name, workers=workers, spec=job_spec, env=spec.credential_env(), attempt="drill",
                  labels={"priority": "critical", "purpose": "dr-drill", "drill": drill[:60]})
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = repr(backend.run(job, admission_timeout_s=30, log=log.info))
        except BaseException as exc:  # noqa: BLE001 - read by the drill (a cancel ends it on purpose)
            outcome["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    gang = TrainingGang(backend, name, place, checkpoint.step, thread, outcome)
    return gang, {"run_key": run_key, "model": model.name, "resumed_step": checkpoint.step,
                  "checkpoint_every_steps": every, "workers": workers, "dataset": data.dataset,
                  "dataset_version": data.manifest_key, "gang": name, "checkpoint_place": place.uri}


def wait_stepping(gang: TrainingGang, timeout_s: float, poll_s: float = 0.1) -> tuple[int | None, float | None]:
    """(step, when) of the first checkpoint committed beyond the resume point; (None, None) if none
    came within ``timeout_s`` or the gang ended first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        step = gang.stepped_beyond()
        if step is not None:
            return step, time.time()
        if not gang.thread.is_alive():
            step = gang.stepped_beyond()
            return (step, time.time()) if step is not None else (None, None)
        time.sleep(poll_s)
    return None, None
