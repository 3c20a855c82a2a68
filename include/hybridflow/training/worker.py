"""One rank of a training gang: ``python -m hybridflow.training.worker --spec job.json``.

The launcher (a gang backend) starts ``WORLD_SIZE`` of these with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set (the rest of ``torchrun``'s variables are filled in and
exported: :mod:`hybridflow.training.ranks`); each rank picks its device and the gang's backend
(``cuda:<LOCAL_RANK>`` and NCCL, or CPU and gloo: :mod:`hybridflow.training.device`); credentials
for the stores arrive in the environment (see :meth:`StoreSpec.from_dict`), never in the spec. Each rank imports the registered model's training
function, joins the process group and calls it with a :class:`~hybridflow.training.context.TrainingContext`.

job.json::

    {
      "run_key": "...",                                  # names the run in logs
      "model": {"name": "...", "entrypoint": "pkg.mod:train", "hyperparameters": {...}},
      "training": {"precision": "bf16", "optimizer": "adamw", "sharding": "zero3"},  # optional: the Params
      "dataset": {"name", "format", "splits": {split: [files]}, "columns": [...], "classification"},
      "data": {...},                                     # where to read it (hybridflow.training.data); alias "source"
      "checkpoint_store": {StoreSpec},                   # primary place: checkpoints, model/final.pt, result.json
      "checkpoint_replica": {StoreSpec} | null,          # second place; each checkpoint is replicated there
      "checkpoint_every_steps": 50,
      "checkpoint_every_seconds": null,                  # optional: also checkpoint on a timer
      "keep": 3,                                         # committed checkpoints kept in each place
      "preemption_grace_s": 30,                          # SIGTERM -> SIGKILL: the last checkpoint commits within it
      "attempt": "try-1",                                # names this launch: attempts/<attempt>.json in the primary
      "log_every_steps": 50                              # optional
    }

Exit codes: 0 done, 75 (:data:`PREEMPTED_EXIT_CODE`) after a stop on SIGTERM with the last checkpoint
committed (rerun to resume), 1 anything else, the training function's traceback in the log.

Environment: ``HYBRIDFLOW_DEVICE`` (cuda, cpu or auto; see :mod:`hybridflow.training.device`),
``HYBRIDFLOW_WORKER_THREADS`` (intra-op threads, default 1), ``HYBRIDFLOW_DEBUG_LOGGERS``
(comma-separated logger names logged at DEBUG, e.g. ``hybridflow.training.checkpoint``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hybridflow.storage.objectstore import StoreSpec, open_store
from hybridflow.training.checkpoint import CheckpointStore
from hybridflow.training.context import (
    FINAL_MODEL_KEY,
    PREEMPTED_EXIT_CODE,
    RESULT_KEY,
    Preemption,
    attempt_status_key,
    report_attempt,
)
from hybridflow.training.device import DEVICE_ENV, DeviceChoice, choose_device
from hybridflow.training.ranks import read_rank_env

__all__ = ["FINAL_MODEL_KEY", "PREEMPTED_EXIT_CODE", "RESULT_KEY", "JobSpec", "attempt_status_key", "main"]

log = logging.getLogger("hybridflow.training.worker")


@dataclass(frozen=True)
class JobSpec:
    run_key: str
    model: dict
    dataset: dict
    data: dict
    checkpoint_store: dict
    checkpoint_every_steps: int
    keep: int = 3
    checkpoint_every_seconds: float | None = None
    checkpoint_replica: dict | None = None
    preemption_grace_s: float = 30.0
    attempt: str = "1"
    log_every_steps: int = 50
    # Fault drill: {"rank": r, "step": s} makes rank r fail when it logs step s (gang failure handling).
    inject_failure: dict | None = None
    # precision, optimizer, sharding (gpumem.TrainSetting); absent: the Params' defaults
    training: dict | None = None
    # The cluster the gang runs on, noted in every checkpoint it commits: a retried train task resumes
    # where the run's newest checkpoint was made (hybridflow.training.failover.resume_placement).
    cluster: str | None = None

    @property
    def setting(self):
        from hybridflow.gpumem import TrainSetting

        return TrainSetting.from_dict(self.training)

    @classmethod
    def from_dict(cls, body: dict) -> JobSpec:
        body = dict(body)
        if "source" in body:  # accepted alias: the staging step calls the data source "source"
            if "data" in body:
                raise ValueError("job spec names its data source twice ('data' and 'source'); keep one")
            body["data"] = body.pop("source")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(body) - known)
        if unknown:
            raise ValueError(f"job spec has unknown keys {unknown}; known keys are {sorted(known)}")
        missing = sorted(k for k in ("run_key", "model", "dataset", "data", "checkpoint_store",
                                     "checkpoint_every_steps") if k not in body)
        if missing:
            raise ValueError(f"job spec lacks {missing}")
        spec = cls(**body)
        if spec.checkpoint_every_steps < 1 or spec.keep < 1:
            raise ValueError("checkpoint_every_steps and keep must be positive")
        if spec.preemption_grace_s <= 0 or (
            spec.checkpoint_every_seconds is not None and spec.checkpoint_every_seconds <= 0
        ):
            raise ValueError("preemption_grace_s and checkpoint_every_seconds must be positive")
        if not spec.attempt or "/" in spec.attempt:
            raise ValueError(f"attempt {spec.attempt!r} must be a non-empty name without '/'")
        if not {"name", "entrypoint"} <= set(spec.model):
            raise ValueError("job spec model needs name and entrypoint")
        from hybridflow.gpumem import TrainSetting

        TrainSetting.from_dict(spec.training)  # an unknown precision, optimizer or sharding fails here
        return spec


def run(spec: JobSpec, train_fn, rank: int, world_size: int, preemption: Preemption,
        device: DeviceChoice | None = None) -> int:
    """Join the gang on ``device`` (default: CPU and gloo), call the training function, finish its
    checkpoints; the exit code."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from hybridflow.training.context import CheckpointHandle, CheckpointPolicy, TrainingContext
    from hybridflow.training.data import open_dataset

    # Ranks share the machine's cores; more intra-op threads per rank only oversubscribe them.
    torch.set_num_threads(max(1, int(os.environ.get("HYBRIDFLOW_WORKER_THREADS", "1"))))
    store, places = _open_places(spec)
    dataset = open_dataset(spec.data, spec.dataset)

    # Collectives must outlast rank 0's last checkpoint, which the other ranks wait for.
    timeout = timedelta(seconds=max(60.0, spec.preemption_grace_s + 30.0))
    device = device or DeviceChoice(device="cpu", backend="gloo", name="cpu", local_rank=0, requested="cpu")
    # device_id binds NCCL's communicator to this rank's GPU (barriers and object collectives use it).
    dist.init_process_group(device.backend, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=torch.device(device.device) if device.is_cuda else None)
    status: dict = {"attempt": spec.attempt, "run_key": spec.run_key, "world_size": world_size,
                    "model": spec.model["name"], **device.record()}

    def report(**fields) -> None:
        if rank == 0:
            status.update(fields)
            report_attempt(store, spec.attempt, status)

    workdir = Path(tempfile.mkdtemp(prefix=f"hf-{spec.run_key[:40]}-rank{rank}-"))
    ctx: TrainingContext | None = None
    try:
        policy = CheckpointPolicy(every_steps=spec.checkpoint_every_steps, every_seconds=spec.checkpoint_every_seconds,
                                  keep=spec.keep, grace_s=spec.preemption_grace_s)
        handle = CheckpointHandle(
            places, policy, rank=rank, world_size=world_size, preemption=preemption, workdir=workdir,
            meta=lambda: {"run_key": spec.run_key, "launch": spec.attempt, "model": spec.model["name"],
                          "cluster": spec.cluster,
                          "start_step": handle.restored_step,
                          "loss": (ctx.metrics.get("loss") or [(0, None)])[-1][1] if ctx else None},
            progress=lambda: ctx.last_step if ctx else None,
            on_restore=lambda step: report(start_step=step),
        )
        ctx = TrainingContext(rank=rank, world_size=world_size, run_key=spec.run_key, model=spec.model["name"],
                              hparams=spec.model.get("hyperparameters") or {}, dataset=dataset, checkpoint=handle,
                              preemption=preemption, store=store, log_every_steps=spec.log_every_steps,
                              inject_failure=spec.inject_failure, device=device.device, setting=spec.setting)
        report(start_step=None, outcome="running")
        started = time.monotonic()
        try:
            train_fn(ctx)
            stopped = ctx.stopping
            # Before any other write to the store: when preempted, the last checkpoint must commit
            # within the grace period, or the worker exits 75 at once (the store may be what hangs).
            in_grace = handle.finish()
            if not stopped and not ctx.model_saved and rank == 0:  # rank 0's weights are the model
                # Raised in here so the attempt is reported failed with this message, like any error.
                raise RuntimeError(f"{spec.model['entrypoint']} returned without ctx.save_model(model): there is "
                                   "no trained model to evaluate or serve")
        except BaseException as exc:
            try:
                report(start_step=handle.restored_step, outcome="failed", last_step=ctx.last_step,
                       error=f"{type(exc).__name__}: {exc}")
            except Exception:
                log.exception("could not report the failed attempt")
            raise
        _report_end(spec, ctx, handle, store, report, rank=rank, world_size=world_size, stopped=stopped,
                    in_grace=in_grace, started=started, device=device.record())
        # Nobody leaves before rank 0 has committed, so the launcher never sees a peer's exit and
        # SIGTERMs rank 0 in the middle of its last upload.
        dist.barrier()
        return PREEMPTED_EXIT_CODE if stopped else 0
    finally:
        dist.destroy_process_group()
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)


def _open_places(spec: JobSpec) -> tuple:
    """The primary checkpoint store and every checkpoint place (primary first, then the replica)."""
    store = open_store(StoreSpec.from_dict(spec.checkpoint_store))
    places = [CheckpointStore(store)]
    if spec.checkpoint_replica:
        places.append(CheckpointStore(open_store(StoreSpec.from_dict(spec.checkpoint_replica))))
    return store, places


def _report_end(spec: JobSpec, ctx, handle, store, report, *, rank: int, world_size: int, stopped: bool, in_grace,
                started: float, device: dict) -> None:
    """How the attempt ended: preempted with its last checkpoint committed, or (rank 0) done, with
    result.json written."""
    last_step = max(s for s in (ctx.last_step, handle.saved_step, handle.restored_step) if s is not None)
    if stopped:
        report(outcome="preempted", last_step=last_step, last_committed_step=handle.committed_step,
               sigterm_to_commit_s=in_grace, checkpoints={k: v for k, v in handle.summary().items()
                                                           if k != "history"})
        log.warning("preempted after step %d; last checkpoint step %s committed %ss after SIGTERM (grace %gs), "
                    "exiting %d", last_step, handle.saved_step, in_grace, spec.preemption_grace_s,
                    PREEMPTED_EXIT_CODE)
    elif rank == 0:
        result = _result(spec, ctx, handle, last_step, time.monotonic() - started, world_size)
        result.update(device)  # where the gang trained: device, backend, device name
        result["training"] = ctx.setting.to_dict()  # precision, optimizer, sharding
        store.put_bytes(RESULT_KEY, json.dumps(result, indent=2, sort_keys=True).encode())
        report(outcome="succeeded", last_step=last_step, last_committed_step=handle.committed_step)
        log.info("training done: %s", json.dumps({k: v for k, v in result.items() if k != "metrics"},
                                                  sort_keys=True))


def _result(spec: JobSpec, ctx, handle, last_step: int, train_seconds: float, world_size: int) -> dict:
    """Rank 0's result.json of a finished run: steps, checkpoints, metrics and timings."""
    metrics = ctx.metrics_summary()
    return {
        "run_key": spec.run_key,
        "model": spec.model["name"],
        "hyperparameters": ctx.hparams,
        "final_step": last_step,
        "start_step": handle.restored_step,
        "checkpoints_written": handle.summary().get("written", 0),
        "checkpoints": handle.summary(),  # one entry per checkpoint: sizes, blocking and write times
        "checkpoint_kind": handle.mode,
        "final_loss": (metrics.get("loss") or {}).get("last"),
        "metrics": metrics,
        "train_seconds": round(train_seconds, 3),
        # Steps between the first and last ctx.log and the seconds between them.
        "loop_steps": ctx.loop[2] - ctx.loop[0] if ctx.loop else 0,
        "loop_seconds": round(ctx.loop[3] - ctx.loop[1], 3) if ctx.loop else 0.0,
        "world_size": world_size,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--spec", type=Path, help="job.json written by the launcher")
    # Kubernetes pods get the spec in their environment: no shell or writable file needed.
    source.add_argument("--spec-env", metavar="NAME", help="environment variable holding the job spec JSON")
    args = parser.parse_args(argv)

    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s",
                        stream=sys.stderr)
    for name in filter(None, (n.strip() for n in os.environ.get("HYBRIDFLOW_DEBUG_LOGGERS", "").split(","))):
        logging.getLogger(name).setLevel(logging.DEBUG)
    preemption = Preemption()
    preemption.install()
    try:
        place = read_rank_env()
        rank, world_size = place.rank, place.world_size
        # Training code written for torchrun reads these; every launcher's gaps are filled alike.
        os.environ.update(place.exports())
        raw = args.spec.read_text() if args.spec else os.environ.get(args.spec_env, "")
        if not raw:
            raise ValueError(f"the job spec variable {args.spec_env} is empty or not set")
        spec = JobSpec.from_dict(json.loads(raw))
        log.info("run %s: model %s, rank %d of %d (node %d, local rank %d of %d), master %s:%s", spec.run_key,
                 spec.model["name"], rank, world_size, place.group_rank, place.local_rank, place.local_world_size,
                 place.master_addr, place.master_port)
        # Before the gang forms: a rank without the GPUs it was given fails here, naming the cause,
        # instead of training on CPU or leaving its peers waiting in a collective.
        device = choose_device(os.environ)
        log.info("device %s (%s), backend %s, %s=%s", device.device, device.name, device.backend, DEVICE_ENV,
                 device.requested)
        setting = spec.setting
        log.info("precision %s, optimizer %s, sharding %s (the run's Params, as admission estimated them)",
                 setting.precision, setting.optimizer, setting.sharding)
        from hybridflow.config.registry import resolve

        # Import the training function before joining the gang: a broken entrypoint fails every rank
        # at once instead of leaving peers waiting in a collective.
        train_fn = resolve(spec.model["entrypoint"], argument="ctx")
        return run(spec, train_fn, rank, world_size, preemption, device)
    except Exception:
        log.exception("rank %s failed", rank)
        return 1


if __name__ == "__main__":
    sys.exit(main())
