"""One rank of a data-parallel training gang: ``python -m hybridflow.training.worker --spec job.json``.

The launcher (a gang backend) starts ``WORLD_SIZE`` of these with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set; credentials for the stores arrive in the environment
(see :meth:`StoreSpec.from_dict`), never in the spec file.

job.json::

    {
      "run_key": "digits-2024-01-01-abc",            # names the run in logs
      "data": {"kind": "local", "path": "/private/datasets/digits"}   # alias key: "source"
            | {"kind": "manifest", "store": {StoreSpec}, "manifest_key": "datasets/digits/versions/<v>.json"},
      "checkpoint_store": {StoreSpec},                # primary place: checkpoints, model/final.pt, result.json
      "checkpoint_replica": {StoreSpec} | null,       # second place; each checkpoint is replicated there
      "train_steps": 300,                             # total optimiser steps (steps are numbered 1..N)
      "checkpoint_every_steps": 50,
      "checkpoint_every_seconds": null,               # optional: also checkpoint on a timer
      "batch_size": 64,                               # per rank; the global batch is batch_size * world_size
      "learning_rate": 0.05,
      "keep": 3,                                      # committed checkpoints kept in each place
      "preemption_grace_s": 30,                       # SIGTERM -> SIGKILL: the final checkpoint commits within it
      "attempt": "try-1",                             # names this launch: attempts/<attempt>.json in the primary
      "momentum": 0.9, "seed": 0, "log_every_steps": 50, "hidden": 128    # optional
    }

A checkpoint is two shards, ``model.pt`` and ``optimizer.pt``, written by rank 0 (DDP keeps every
rank's replica identical) through :class:`~hybridflow.training.checkpointer.AsyncCheckpointer`: the
training thread only copies tensors; serialising and uploading happen in the background.

Environment: ``HYBRIDFLOW_WORKER_THREADS`` (intra-op threads, default 1), ``HYBRIDFLOW_DEBUG_LOGGERS``
(comma-separated logger names logged at DEBUG, e.g. ``hybridflow.training`` for every shard and
manifest write).

Exit codes: 0 done, :data:`PREEMPTED_EXIT_CODE` after SIGTERM (state checkpointed, rerun to resume),
1 anything else. Resuming is exact: batches are a pure function of (seed, step), so a run that
resumes from step k sees the same data as one that never stopped.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hybridflow.storage.objectstore import StoreSpec, open_store
from hybridflow.training.checkpoint import CheckpointStore

# EX_TEMPFAIL: the worker stopped on SIGTERM (spot reclaim, cancel, launcher death) after
# checkpointing; the run is resumable, so callers should retry rather than treat it as a bug.
PREEMPTED_EXIT_CODE = 75

FINAL_MODEL_KEY = "model/final.pt"
RESULT_KEY = "result.json"

log = logging.getLogger("hybridflow.training.worker")


@dataclass(frozen=True)
class JobSpec:
    run_key: str
    data: dict
    checkpoint_store: dict
    train_steps: int
    checkpoint_every_steps: int
    batch_size: int
    learning_rate: float
    keep: int = 3
    checkpoint_every_seconds: float | None = None
    # The second place the latest checkpoints are kept (private storage or cluster scratch).
    checkpoint_replica: dict | None = None
    # SIGTERM -> SIGKILL time the launcher gives a worker: the final checkpoint must commit within it.
    preemption_grace_s: float = 30.0
    attempt: str = "1"  # names this launch in attempts/<attempt>.json
    momentum: float = 0.9
    seed: int = 0
    log_every_steps: int = 50
    hidden: int = 128
    # Fault drill: {"rank": r, "step": s} makes rank r exit 1 at step s (tests gang failure handling).
    inject_failure: dict | None = None

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
        spec = cls(**body)
        if spec.train_steps < 1 or spec.batch_size < 1 or spec.checkpoint_every_steps < 1:
            raise ValueError("train_steps, batch_size and checkpoint_every_steps must be positive")
        if spec.preemption_grace_s <= 0 or (
            spec.checkpoint_every_seconds is not None and spec.checkpoint_every_seconds <= 0
        ):
            raise ValueError("preemption_grace_s and checkpoint_every_seconds must be positive")
        if not spec.attempt or "/" in spec.attempt:
            raise ValueError(f"attempt {spec.attempt!r} must be a non-empty name without '/'")
        return spec


class _Preemption:
    """Remembers SIGTERM; the training loop decides when to stop, so a step is never torn."""

    def __init__(self) -> None:
        self.requested = False
        self.at = 0.0  # time.monotonic() of the first SIGTERM

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        if not self.requested:
            self.at = time.monotonic()
            log.warning("SIGTERM received: finishing the current step, then checkpointing")
        self.requested = True


def load_train_bytes(data: dict) -> bytes:
    kind = data.get("kind")
    if kind == "local":
        path = Path(data["path"]) / "train.csv"
        if not path.is_file():
            raise FileNotFoundError(f"training data {path} does not exist")
        return path.read_bytes()
    if kind == "manifest":
        from hybridflow.storage.manifest import DatasetManifest, fetch_verified

        store = open_store(StoreSpec.from_dict(data["store"]))
        manifest = DatasetManifest.from_json(store.get_bytes(data["manifest_key"]))
        log.info("dataset %s version %s from %s", manifest.dataset, manifest.version, store.uri)
        return fetch_verified(store, manifest.entry("train.csv"))
    raise ValueError(f"data source kind {kind!r} is not supported; use 'local' or 'manifest'")


class StepSampler:
    """Deterministic sharding by step: epoch e is a permutation seeded by (seed, e); step s takes
    the next global batch from it and rank r takes every world_size-th row of that batch."""

    def __init__(self, n: int, batch_size: int, rank: int, world_size: int, seed: int) -> None:
        import torch

        self._torch = torch
        self.global_batch = batch_size * world_size
        if n < self.global_batch:
            raise ValueError(f"{n} training rows cannot fill one global batch of {self.global_batch}")
        self.n, self.rank, self.world_size, self.seed = n, rank, world_size, seed
        self.steps_per_epoch = n // self.global_batch
        self._epoch: int | None = None
        self._perm = None

    def indices(self, step: int):
        epoch, i = divmod(step - 1, self.steps_per_epoch)
        if epoch != self._epoch:
            gen = self._torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = self._torch.randperm(self.n, generator=gen)
            self._epoch = epoch
        batch = self._perm[i * self.global_batch : (i + 1) * self.global_batch]
        return batch[self.rank :: self.world_size]


MODEL_SHARD = "model.pt"
OPTIMIZER_SHARD = "optimizer.pt"


def attempt_status_key(attempt: str) -> str:
    """Where a worker gang reports one attempt (start step, last step, outcome) in the primary place."""
    return f"attempts/{attempt}.json"


def _final_checkpoint_margin(grace_s: float) -> float:
    # Leave part of the grace period for logging and process exit, so the launcher's SIGKILL does not
    # land on a worker that has committed but not yet exited 75.
    return min(2.0, 0.1 * grace_s)


def train(spec: JobSpec, train_csv: bytes, rank: int, world_size: int, preemption: _Preemption) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hybridflow.datasets import parse_split
    from hybridflow.training.checkpoint import latest_of
    from hybridflow.training.checkpointer import AsyncCheckpointer, torch_deserialise
    from hybridflow.training.model import build_model

    # Ranks share the machine's cores; more intra-op threads per rank only oversubscribe them.
    torch.set_num_threads(max(1, int(os.environ.get("HYBRIDFLOW_WORKER_THREADS", "1"))))
    x_np, y_np = parse_split(train_csv)
    x, y = torch.tensor(x_np), torch.tensor(y_np)  # copies: pandas may hand back read-only arrays
    store = open_store(StoreSpec.from_dict(spec.checkpoint_store))
    places = [CheckpointStore(store)]
    if spec.checkpoint_replica:
        places.append(CheckpointStore(open_store(StoreSpec.from_dict(spec.checkpoint_replica))))

    # Collectives must outlast rank 0's final checkpoint, which the other ranks wait for.
    timeout = timedelta(seconds=max(60.0, spec.preemption_grace_s + 30.0))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    status: dict = {"attempt": spec.attempt, "run_key": spec.run_key, "world_size": world_size}

    def report(**fields) -> None:
        if rank == 0:
            status.update(fields)
            store.put_bytes(attempt_status_key(spec.attempt), json.dumps(status, sort_keys=True).encode())

    try:
        model = build_model(spec.hidden)
        optimizer = torch.optim.SGD(model.parameters(), lr=spec.learning_rate, momentum=spec.momentum)

        # Rank 0 picks the checkpoint (newest that verifies in either place) and tells the others,
        # so every rank resumes from the same step even if a checkpoint lands while they look.
        chosen: list = [None]
        found = None
        if rank == 0:
            found = latest_of(places)
            chosen = [(found[0].step, found[1]) if found else (0, 0)]
        dist.broadcast_object_list(chosen, src=0)
        start_step, place_index = (int(v) for v in chosen[0])
        final_loss = float("nan")
        resumed_from = None
        if start_step > 0:
            ckpt = found[0] if rank == 0 else places[place_index].load(start_step)
            model.load_state_dict(torch_deserialise(ckpt.shards[MODEL_SHARD]))
            optimizer.load_state_dict(torch_deserialise(ckpt.shards[OPTIMIZER_SHARD]))
            final_loss = float(ckpt.meta.get("loss", final_loss))
            resumed_from = places[place_index].uri
            log.info("resuming from checkpoint step %d (%s)", start_step, resumed_from)
        else:
            log.info("no committed checkpoint in %s: starting from step 0", ", ".join(p.uri for p in places))
        report(start_step=start_step, resumed_from=resumed_from, outcome="running")

        ddp = DistributedDataParallel(model)
        sampler = StepSampler(len(x), spec.batch_size, rank, world_size, spec.seed)
        loss_fn = torch.nn.CrossEntropyLoss()
        step = start_step
        checkpointer = None
        if rank == 0:
            checkpointer = AsyncCheckpointer(
                places[0], spec.keep, replica=places[1] if len(places) > 1 else None, progress=lambda: step
            )
        last_snapshot = start_step
        last_save_time = time.monotonic()
        started = time.monotonic()
        window_start, window_steps = started, 0
        preempted = False
        due = False
        completed = start_step  # the last step every rank finished

        def state() -> dict:
            return {MODEL_SHARD: model.state_dict(), OPTIMIZER_SHARD: optimizer.state_dict()}

        def meta(loss: float) -> dict:
            return {"loss": loss, "run_key": spec.run_key, "attempt": spec.attempt, "start_step": start_step}

        try:
            for step in range(start_step + 1, spec.train_steps + 1):
                fault = spec.inject_failure
                if fault and int(fault.get("rank", -1)) == rank and int(fault.get("step", -1)) == step:
                    raise RuntimeError(f"injected failure on rank {rank} at step {step}")
                idx = sampler.indices(step)
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(ddp(x[idx]), y[idx])
                loss.backward()  # DDP averages gradients across the gang here
                optimizer.step()
                # One small all-reduce carries both the mean loss and "anyone got SIGTERM?", so all
                # ranks stop after the same step and nobody waits in a collective for a peer that left.
                stats = torch.tensor([loss.item(), 1.0 if preemption.requested else 0.0])
                dist.all_reduce(stats)
                final_loss = stats[0].item() / world_size
                preempted = stats[1].item() > 0
                completed = step
                window_steps += 1

                if rank == 0 and (step % spec.log_every_steps == 0 or step == spec.train_steps):
                    now = time.monotonic()
                    log.info(
                        "step %d/%d loss %.4f %.1f steps/s",
                        step,
                        spec.train_steps,
                        final_loss,
                        window_steps / max(now - window_start, 1e-9),
                    )
                    window_start, window_steps = now, 0
                if preempted:
                    break
                if checkpointer is None:
                    continue
                due = (
                    due
                    or step % spec.checkpoint_every_steps == 0
                    or (
                        spec.checkpoint_every_seconds is not None
                        and time.monotonic() - last_save_time >= spec.checkpoint_every_seconds
                    )
                )
                # While the previous checkpoint is still being written the offer is declined and
                # repeated at the next step: training never waits for storage.
                if due and step < spec.train_steps and checkpointer.offer(step, state, meta(final_loss)):
                    due, last_snapshot, last_save_time = False, step, time.monotonic()
            loop_seconds = time.monotonic() - started

            # A final checkpoint at the last completed step: on preemption it is the resume point;
            # at the end it makes a rerun of a finished run a no-op.
            committed_in_grace = None
            if checkpointer is not None:

                def save_final() -> None:
                    if step > last_snapshot:
                        checkpointer.save(step, state, meta(final_loss))

                if preempted:
                    committed_in_grace = _final_checkpoint_within_grace(
                        checkpointer, step, save_final, preemption, spec
                    )
                else:
                    save_final()
                    checkpointer.wait()
        except BaseException as exc:
            try:
                report(outcome="failed", last_step=completed, error=f"{type(exc).__name__}: {exc}")
            except Exception:
                log.exception("could not report the failed attempt")
            raise
        finally:
            if checkpointer is not None:
                checkpointer.close()
        train_seconds = time.monotonic() - started
        summary = checkpointer.summary() if checkpointer is not None else {}
        if preempted and rank == 0:
            report(
                outcome="preempted",
                last_step=step,
                last_committed_step=checkpointer.primary_step,
                sigterm_to_commit_s=committed_in_grace,
                checkpoints={k: v for k, v in summary.items() if k != "history"},
            )
            log.warning(
                "preempted after step %d; final checkpoint committed %.2fs after SIGTERM (grace %gs), exiting %d",
                step,
                committed_in_grace,
                spec.preemption_grace_s,
                PREEMPTED_EXIT_CODE,
            )
        elif preempted:
            log.warning(
                "preempted after step %d; rank 0 writes the final checkpoint, exiting %d",
                step,
                PREEMPTED_EXIT_CODE,
            )
        elif rank == 0:
            buf = io.BytesIO()
            torch.save(model.state_dict(), buf)
            store.put_bytes(FINAL_MODEL_KEY, buf.getvalue())
            result = {
                "run_key": spec.run_key,
                "final_step": step,
                "start_step": start_step,
                "checkpoints_written": checkpointer.written if checkpointer else 0,
                "checkpoints": summary,  # with one entry per checkpoint: sizes, blocking and write times
                "final_loss": final_loss,
                "train_seconds": round(train_seconds, 3),
                "loop_seconds": round(loop_seconds, 3),
                "world_size": world_size,
            }
            store.put_bytes(RESULT_KEY, json.dumps(result, indent=2, sort_keys=True).encode())
            report(outcome="succeeded", last_step=step, last_committed_step=checkpointer.primary_step)
            log.info("training done: %s", json.dumps(result, sort_keys=True))
        # Nobody leaves before rank 0 has committed, so the launcher never sees a peer's exit and
        # SIGTERMs rank 0 in the middle of its final upload.
        dist.barrier()
        return PREEMPTED_EXIT_CODE if preempted else 0
    finally:
        dist.destroy_process_group()


def _final_checkpoint_within_grace(
    checkpointer, step: int, save_final, preemption: _Preemption, spec: JobSpec
) -> float:
    """Finish the write in flight, then write the final checkpoint, both before the SIGKILL is due.
    Returns the seconds from SIGTERM to the final commit. If storage cannot keep up, exits 75 at
    once: the newest committed checkpoint is the resume point, and a partial one is never loaded."""
    deadline = preemption.at + spec.preemption_grace_s - _final_checkpoint_margin(spec.preemption_grace_s)

    def left() -> float:
        return max(0.0, deadline - time.monotonic())

    done = checkpointer.wait(timeout=left())
    if done:
        save_final()  # the uploader is idle now: this only takes the snapshot
        done = checkpointer.wait(timeout=left())
    if done:
        return round(time.monotonic() - preemption.at, 3)
    if checkpointer.primary_step == step:
        log.warning(
            "final checkpoint step %d committed to %s but not yet replicated within the %gs grace period",
            step,
            checkpointer.primary.uri,
            spec.preemption_grace_s,
        )
    else:
        log.error(
            "final checkpoint step %d not committed within the %gs grace period; the retry resumes from "
            "the newest earlier checkpoint (raise training.preemption_grace_s if this repeats)",
            step,
            spec.preemption_grace_s,
        )
    logging.shutdown()
    # The upload thread may be stuck in storage I/O; a normal exit would join it past the SIGKILL.
    os._exit(PREEMPTED_EXIT_CODE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--spec", type=Path, help="job.json written by the launcher")
    # Kubernetes pods get the spec in their environment: no shell or writable file needed.
    source.add_argument("--spec-env", metavar="NAME", help="environment variable holding the job spec JSON")
    args = parser.parse_args(argv)

    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank{rank} %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    # e.g. HYBRIDFLOW_DEBUG_LOGGERS=hybridflow.training.checkpoint logs every shard and manifest write.
    for name in filter(None, (n.strip() for n in os.environ.get("HYBRIDFLOW_DEBUG_LOGGERS", "").split(","))):
        logging.getLogger(name).setLevel(logging.DEBUG)
    preemption = _Preemption()
    preemption.install()
    try:
        raw = args.spec.read_text() if args.spec else os.environ.get(args.spec_env, "")
        if not raw:
            raise ValueError(f"the job spec variable {args.spec_env} is empty or not set")
        spec = JobSpec.from_dict(json.loads(raw))
        log.info(
            "run %s: rank %d of %d, master %s:%s",
            spec.run_key,
            rank,
            world_size,
            os.environ.get("MASTER_ADDR"),
            os.environ.get("MASTER_PORT"),
        )
        # Fetch (and verify) the data before importing torch or joining the gang: a bad data source
        # then fails every rank within a second instead of after the slow imports.
        train_csv = load_train_bytes(spec.data)
        return train(spec, train_csv, rank, world_size, preemption)
    except Exception:
        log.exception("rank %d failed", rank)
        return 1


if __name__ == "__main__":
    sys.exit(main())
