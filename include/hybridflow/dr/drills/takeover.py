"""The takeover a drill performs on the DR cluster: the critical endpoint served from the replicated
model, and a small training run resumed from the replicated checkpoint, each checked.

- **inference**: the newest replicated version is fetched (verified) from the DR store onto the DR
  cluster's scratch, started with the project's model server, and is healthy once it answers a
  prediction (one instance made from the model's signature);
- **training**: the replicated checkpoint is copied, verified, inside the DR store to the drill's own
  checkpoint place (``drills/<drill>/checkpoints``: the replicated sets stay add-only), and a gang
  of the run's registered model starts on the DR cluster's backend reading the replicated dataset
  version; it is stepping once it commits a checkpoint beyond the one it resumed from.

On a ``kubernetes`` DR cluster the gang is a gang job there (:mod:`hybridflow.backends.k8s`): the
blocking ``run`` (submit, then poll until it ends) waits in a thread of the task as the local
backend's does, on the DR cluster's training node pool (:func:`training_pool`) in the queue of the
team of the model's project. Its pods read the data and write checkpoints in the DR store, with the
store's keys in the job's Secret. The job's name derives from the drill (:func:`gang_name`), so a
restarted task or ``fail_back`` finds and deletes it.

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

from hybridflow.dr.drills.report import DrillError
from hybridflow.storage.objectstore import StoreSpec, open_store
from hybridflow.training.checkpoint import CheckpointStore

GANG_PREFIX = "drill-"
log = logging.getLogger("hybridflow.dr")


def gang_name(drill: str, backend: Any) -> str:
    """The drill's gang on the DR cluster of ``backend``: derived from the drill id alone (the same for
    every try of its steps)."""
    return backend.gang_name("dr_drill", drill, "take_over", readable=f"{GANG_PREFIX}{drill}"[:120])


def training_pool(dr: Any, workers: int) -> str:
    """The node pool of kubernetes cluster ``dr`` the drill's gang runs on: one with ``workers`` GPUs,
    other than the DR inference pool where one fits, on-demand before spot, the largest first."""
    serving = dr.dr.serving.node_pool if dr.dr is not None and dr.dr.serving is not None else None
    fits = [p for p in dr.node_pools if p.gpus >= workers]
    if not fits:
        largest = max(dr.node_pools, key=lambda p: p.gpus)
        raise DrillError("workers", f"{workers}: a gang runs on one node pool and the largest of the DR cluster "
                                    f"{dr.name} ({largest.name}) has {largest.gpus} GPUs; use 1..{largest.gpus}")
    return min(fits, key=lambda p: (p.name == serving, p.spot, -p.gpus, p.name)).name


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
    from hybridflow.dr.drills.replicas import fetch_model
    from hybridflow.serving.takeover import probe_instance, replica_server

    model = fetch_model(spec, endpoint, scratch / "models")
    fetched = time.time()
    server = replica_server(model.bundle, endpoint, model.version, start_timeout_s=start_timeout_s)
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


def serves_on_dr_pool(estate, dr) -> bool:
    """Whether a drill serves on the DR cluster's inference pool (``clusters.<dr>.dr.serving``): a
    kubernetes DR cluster with a Kubernetes deploy target. Otherwise the model server runs on this
    machine, where the model gateway is (serving.target local)."""
    from hybridflow.serving import target_name

    return dr.runs_pods and target_name(estate.pipeline.serving) in ("kubernetes", "kserve")


def check_dr_pool(estate, dr) -> None:
    """DrillError naming ``clusters.<dr>.dr.serving`` when the drill must serve there and cannot."""
    from hybridflow.errors import ConfigError
    from hybridflow.serving import target_name
    from hybridflow.serving.takeover import dr_pool

    try:
        dr_pool(dr)
    except ConfigError as exc:
        raise DrillError("dr_cluster", f"{dr.name} serves the drill's endpoint on its inference pool (serving.target "
                                       f"{target_name(estate.pipeline.serving)}): {exc}") from None


def start_inference_on_pool(estate, dr, spec: StoreSpec, endpoint: str, scratch: Path) -> dict[str, Any]:
    """What was measured serving the newest replica of ``endpoint`` on the DR cluster's inference pool
    (:func:`hybridflow.dr.failover.serving_k8s.start_on_dr`): healthy once its check passed, a prediction
    answered at the InferenceService's URL (kind kserve) or every replica ready (kind deployment,
    whose in-cluster Service this machine cannot call)."""
    from hybridflow.dr.failover.serving_k8s import start_on_dr

    out = start_on_dr(estate, dr, spec, endpoint, None, scratch, log=log)
    healthy = time.time()  # the check is the last thing start_on_dr does
    return {"endpoint": endpoint, "model": out.get("model") or endpoint, "version": out["version"],
            "replicated_at": out.get("replicated_at"), "healthy_ts": healthy, "prediction": out.get("prediction"),
            "check": "ready" if out.get("prediction") is None else "prediction", "cluster": out["cluster"],
            "namespace": out["namespace"], "url": out["url"], "kind": out["kind"], "source": out["source"],
            "started": out["started"]}


def seed_checkpoint(spec: StoreSpec, checkpoint: Any, place_name: str) -> StoreSpec:
    """The drill's checkpoint place ``drills/<place_name>/checkpoints`` holding a verified copy of
    ``checkpoint`` (the replicated one)."""
    place = spec.child(f"drills/{place_name}/checkpoints")
    target = CheckpointStore(open_store(place))
    if checkpoint.step not in target.committed_steps():  # a rerun finds it there already
        target.save(checkpoint.step, checkpoint.shards, dict(checkpoint.meta))
    return place


@dataclass
class TrainingGang:
    """The drill's gang, waited for in a thread of this task: the local backend supervises its
    processes there; on Kubernetes the thread polls the gang job until it ends."""

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


def _registered_model(estate, run_key: str, checkpoint: Any):
    model_name = checkpoint.meta.get("model")
    if model_name not in estate.models.models:
        raise DrillError("run_key", f"the replicated checkpoint of {run_key} names model {model_name!r}, which is "
                                    "not in models.yaml")
    return estate.models.get(model_name)


def _kubernetes_launch(estate, dr, backend, model, workers: int, window_s: float) -> tuple[dict, dict]:
    """(keyword arguments of the Kubernetes backend's ``run``, the gang's labels): the training node
    pool, and the queue of the team of the model's project, which must exist on ``dr``."""
    project = estate.projects.get(model.project) if model.project else None
    if project is None:
        raise DrillError("run_key", f"model {model.name} names no project of projects.yaml, so the drill cannot "
                                    f"tell whose queue its gang waits in on {dr.name}; set models.{model.name}.project")
    queue = estate.queue_of(project.team)
    if backend.queue_exists(queue) is False:  # None: unreadable now; the submission says more
        kind = "Queue" if dr.scheduler == "volcano" else f"LocalQueue in namespace {dr.k8s_namespace}"
        raise DrillError("dr_cluster", f"{dr.name} has no {dr.scheduler} {kind} {queue!r} (team {project.team}'s "
                                       f"queue, teams.{project.team}.queue); create it on the DR cluster")
    # The gang is waited for as long as the drill waits for it to step, polled often enough to see it end.
    run = {"pool": training_pool(dr, workers), "queue": queue, "admission_timeout_s": window_s,
           "poll_s": min(estate.pipeline.training.kubernetes_poll_s, 5.0)}
    return run, {"project": model.project, "team": project.team, "interruptible": "false"}


def _gone(backend, name: str, timeout_s: float = 60) -> None:
    """Wait until an earlier try's gang job, just deleted, is gone: submitting now would re-attach to it."""
    from hybridflow.backends.base import MISSING

    deadline = time.monotonic() + timeout_s
    while backend.status(name).phase != MISSING:
        if time.monotonic() > deadline:
            raise DrillError("take_over", f"gang job {name} of an earlier try is still being deleted on "
                                          f"{backend.cluster_name}; clear take_over in a minute")
        time.sleep(0.5)


def _run_key(run_key: str, drill: str) -> str:
    # Also the gang job's run-key label on Kubernetes: at most 63 characters, ending alphanumeric.
    return f"{run_key}-{drill}"[:63].rstrip("-_.")


def start_training(estate, settings, dr, spec: StoreSpec, run_key: str, drill: str, attempt: str, *,
                   workers: int = 1, extra_steps: int = 20,
                   window_s: float = 240) -> tuple[TrainingGang, dict[str, Any]]:
    """Resume ``run_key`` from its replicated checkpoint on ``dr`` for ``extra_steps`` more steps
    (``window_s``: how long the drill waits for it to step). Each ``attempt`` of the step gets a
    checkpoint place of its own, so a rerun resumes from the replicated checkpoint again, never from
    what an earlier try trained."""
    from hybridflow.backends import gang_backend
    from hybridflow.backends.base import GangJob
    from hybridflow.dr.drills.replicas import newest_dataset, replicated_checkpoint

    checkpoint = replicated_checkpoint(spec, run_key)
    model = _registered_model(estate, run_key, checkpoint)
    data = newest_dataset(spec, model.dataset)
    if data is None:
        raise DrillError("run_key", f"no version of dataset {model.dataset} (model {model.name}) is replicated to "
                                    "the DR store; run dr_replication")
    backend = gang_backend(dr, estate, settings.state_dir)
    name = gang_name(drill, backend)
    labels = {"priority": "critical", "purpose": "dr-drill", "drill": drill[:60]}
    run_kw: dict[str, Any] = {"admission_timeout_s": 30}
    if dr.runs_pods:
        run_kw, more = _kubernetes_launch(estate, dr, backend, model, workers, window_s)
        labels.update(more)
    hparams = dict(model.defaults())
    if "steps" in hparams:  # a small run: a few steps beyond the resume point
        hparams["steps"] = checkpoint.step + extra_steps
    every = max(1, extra_steps // 4)
    place = seed_checkpoint(spec, checkpoint, f"{drill}/{attempt}")
    job_spec = {
        "run_key": _run_key(run_key, drill), "attempt": "drill",
        "model": {"name": model.name, "entrypoint": model.entrypoint, "hyperparameters": hparams},
        "dataset": _dataset_info(estate, data),
        "data": {"kind": "manifest", "store": spec.to_dict(), "manifest_key": data.manifest_key},
        "checkpoint_store": place.to_dict(), "checkpoint_every_steps": every, "keep": 3,
        "preemption_grace_s": estate.pipeline.training.preemption_grace_s, "log_every_steps": every,
    }
    job = GangJob(name=name, workers=workers, spec=job_spec, env=spec.credential_env(), attempt="drill",
                  labels=labels)
    # Checked before anything is deleted or started: a job the cluster cannot run fails the step here, by field.
    backend.check_job(job, pool=run_kw.get("pool"), queue=run_kw.get("queue"))
    if backend.cancel(name) and dr.runs_pods:  # an earlier try's gang whose task died: never two
        _gone(backend, name)
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = repr(backend.run(job, log=log, **run_kw))
        except BaseException as exc:  # noqa: BLE001 - read by the drill (a cancel ends it on purpose)
            outcome["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    gang = TrainingGang(backend, name, place, checkpoint.step, thread, outcome)
    where = {"cluster": dr.name, "backend": dr.backend, **({"node_pool": run_kw["pool"], "queue": run_kw["queue"]}
                                                          if dr.runs_pods else {})}
    return gang, {"run_key": run_key, "model": model.name, "resumed_step": checkpoint.step,
                  "checkpoint_every_steps": every, "workers": workers, "dataset": data.dataset,
                  "dataset_version": data.manifest_key, "gang": name, "checkpoint_place": place.uri, **where}


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
