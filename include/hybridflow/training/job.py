"""One run's training on one cluster: what every gang of the run there is given (:class:`TrainJob`,
built from the admitted run, its placement and its staged data), and what comes home when a gang
finishes (:func:`bring_home`: the model bundle in the run's folder and the train task's summary)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.runs import RunIdentity, run_dir
from hybridflow.training.attempts import ATTEMPTS_FILE


@dataclass(frozen=True)
class TrainJob:
    """One run's training on one cluster: what its gangs are given and where their attempts are noted."""

    identity: RunIdentity
    admitted: Any
    placement: dict
    cluster: Any
    run_key: str
    ckpt_spec: Any
    replica_spec: Any
    spec: dict
    model: Any
    env: dict
    attempts_path: Path
    labels: dict
    log: Any
    task_reads_local: bool = True  # the backend's gangs write local places the task can read too
    owner: dict = field(default_factory=dict)  # the train task it is for: GangJob.owner of its gangs
    backend: Any = None  # the cluster's gang backend (backends.gang_backend)

    def places(self) -> list:
        """The checkpoint places this task can read: a Kubernetes cluster's scratch volume is only
        mounted in its pods."""
        from hybridflow.storage.objectstore import open_store

        specs = [self.ckpt_spec, self.replica_spec]
        if not self.task_reads_local:
            specs = [s for s in specs if s.kind != "local"]
        return [open_store(s) for s in specs]

    def bill(self) -> dict:
        return {"run_key": self.run_key, "admitted": self.admitted, "identity": self.identity,
                "placement": self.placement, "log": self.log}


def gang_owner(identity: RunIdentity, task_id: str | None) -> dict[str, str]:
    """``GangJob.owner`` for gangs of task ``task_id`` of the run ``identity`` names."""
    owner = {"dag_id": identity.dag_id, "run_id": identity.run_id, "try_number": str(identity.try_number)}
    return {**owner, "task_id": task_id} if task_id else owner


def build_job(run: dict, placement: dict, staged: dict, identity: RunIdentity, settings, estate, log,
              task_id: str | None = None) -> TrainJob:
    """What every gang of ``run`` on ``placement``'s cluster is given, whatever its backend
    (``task_id``: the train task's, so its gangs carry their owner)."""
    from hybridflow import rundata
    from hybridflow.backends import gang_backend
    from hybridflow.placement.places import cache_store_spec, checkpoint_replica_spec, checkpoint_store_spec
    from hybridflow.placement.reserve import movable, private_only
    from hybridflow.request import AdmittedRun

    admitted = AdmittedRun.from_xcom(dict(run))
    req = admitted.request
    cluster = estate.clusters[placement["cluster"]]
    run_key = run["run_key"]
    entry, model = estate.datasets.get(admitted.dataset), estate.models.get(admitted.model)
    version = rundata.read_version(settings.private_root, run_key)
    ckpt_spec = checkpoint_store_spec(run_key, cluster, settings)
    replica_spec = checkpoint_replica_spec(run_key, cluster, settings)
    training_cfg = estate.pipeline.training
    timer_s = training_cfg.interruptible_checkpoint_every_s if req.interruptible else None
    spec = {
        "run_key": run_key,
        "cluster": cluster.name,
        "model": {"name": model.name, "entrypoint": model.entrypoint, "hyperparameters": admitted.hyperparameters},
        # precision, optimizer, sharding: the setting admission's GPU memory check estimated with
        "training": req.train_setting.to_dict(),
        "dataset": rundata.dataset_info(entry, version, admitted.classification),
        "source": staged["source"],
        "checkpoint_store": ckpt_spec.to_dict(),
        "checkpoint_replica": replica_spec.to_dict(),
        "checkpoint_every_steps": req.checkpoint_every_steps,
        # Interruptible runs may be reclaimed at any time: also checkpoint on a timer.
        "checkpoint_every_seconds": timer_s,
        "preemption_grace_s": training_cfg.preemption_grace_s,
        "keep": training_cfg.checkpoint_keep,
    }
    # Staged data and cache checkpoints share the cluster's cache connection; data read in place
    # from a private bucket needs that bucket's.
    env = cache_store_spec(cluster).credential_env() if cluster.cache else {}
    if staged["source"].get("kind") == "store":
        _, data_env = rundata.source_where_it_lives(entry, settings.private_root, run_key,
                                                    estate.file_roots(settings.home))
        if env and data_env and env != data_env:
            raise ValueError(f"cluster {cluster.name} reads its cache and dataset {entry.name}'s private bucket "
                             "with different credentials; stage the data into the cache instead")
        env = {**env, **data_env}
    backend = gang_backend(cluster, estate, settings.state_dir)
    attempts_path = run_dir(settings.private_root, run_key) / ATTEMPTS_FILE
    return TrainJob(
        identity=identity, admitted=admitted, placement=placement, cluster=cluster,
        run_key=run_key, ckpt_spec=ckpt_spec, replica_spec=replica_spec, spec=spec, model=model,
        env=env,
        attempts_path=attempts_path,
        labels={"project": req.project, "team": admitted.team, "priority": req.priority,
                "interruptible": str(req.interruptible).lower(),
                # Its queue ticket says so: placement keeps private capacity for such work (placement.reserve).
                "private_only": str(private_only(admitted, estate)).lower(),
                "movable": str(movable(admitted, cluster, estate, moves_so_far(attempts_path))).lower()},
        log=log,
        task_reads_local=backend.reads_private_storage,
        owner=gang_owner(identity, task_id),
        backend=backend,
    )


def bring_home(job: TrainJob, gang: str | None, attempts: list[dict], preemptions: int, started: float) -> dict:
    """The finished gang's model into the run's folder as a bundle, and the task's summary for XCom."""
    from hybridflow.bundle import WEIGHTS_FILE, ModelCard, write_bundle
    from hybridflow.storage.objectstore import open_store
    from hybridflow.training.context import FINAL_MODEL_KEY, RESULT_KEY

    store = open_store(job.ckpt_spec)
    summary = json.loads(store.get_bytes(RESULT_KEY))
    bundle = job.attempts_path.parent / "model"  # the run's folder in private storage
    card = ModelCard(**job.model.card(), hyperparameters=dict(job.admitted.hyperparameters), variant="fp32",
                     version=job.run_key)
    write_bundle(bundle, store.get_bytes(FINAL_MODEL_KEY), card)
    model_path = bundle / WEIGHTS_FILE
    gpu_seconds = sum(a["seconds"] * a["workers"] for a in attempts if a.get("seconds") is not None)
    job.log.info(
        "Gang %s finished: steps %s..%s, %s checkpoints, %d preemptions in this try, model at %s",
        gang,
        summary["start_step"],
        summary["final_step"],
        summary["checkpoints_written"],
        preemptions,
        model_path,
    )
    return {
        "job_name": gang,
        "cluster": job.cluster.name,
        "model_path": str(model_path),
        "bundle": str(bundle),
        "checkpoint_store": job.ckpt_spec.uri,
        "checkpoint_replica": job.replica_spec.uri,
        "checkpoints_written": summary["checkpoints_written"],
        "checkpoint_blocked_s_mean": (summary.get("checkpoints") or {}).get("blocked_s_mean"),
        "start_step": summary["start_step"],
        "final_step": summary["final_step"],
        "final_loss": summary.get("final_loss"),
        "metrics": {k: v.get("last") for k, v in (summary.get("metrics") or {}).items()},
        "checkpoint_kind": summary.get("checkpoint_kind"),
        "device": summary.get("device"),  # where rank 0 trained and how the gang talked
        "backend": summary.get("backend"),
        "device_name": summary.get("device_name"),
        "preemptions": preemptions,
        "seconds": round(time.time() - started, 3),
        "gpu_seconds": round(gpu_seconds, 3),
        "attempts": attempts,
    }


def moves_so_far(attempts_path) -> int:
    """How often the run's gangs were moved to make room (attempts that ended ``moved``)."""
    from hybridflow.training.attempts import read_attempts

    return sum(a.get("outcome") == "moved" for a in read_attempts(attempts_path))
