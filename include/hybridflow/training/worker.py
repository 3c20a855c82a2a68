"""One rank of a data-parallel training gang: ``python -m hybridflow.training.worker --spec job.json``.

The launcher (a gang backend) starts ``WORLD_SIZE`` of these with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set; credentials for the stores arrive in the environment
(see :meth:`StoreSpec.from_dict`), never in the spec file.

job.json::

    {
      "run_key": "digits-2024-01-01-abc",            # names the run in logs
      "data": {"kind": "local", "path": "/private/datasets/digits"}   # alias key: "source"
            | {"kind": "manifest", "store": {StoreSpec}, "manifest_key": "datasets/digits/versions/<v>.json"},
      "checkpoint_store": {StoreSpec},                # checkpoints, model/final.pt and result.json go here
      "train_steps": 300,                             # total optimiser steps (steps are numbered 1..N)
      "checkpoint_every_steps": 50,
      "checkpoint_every_seconds": null,               # optional: also checkpoint on a timer
      "batch_size": 64,                               # per rank; the global batch is batch_size * world_size
      "learning_rate": 0.05,
      "keep": 3,                                      # committed checkpoints kept
      "momentum": 0.9, "seed": 0, "log_every_steps": 50, "hidden": 128    # optional
    }

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
from hybridflow.training.checkpoint import AsyncCheckpointer, CheckpointStore

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
        return spec


class _Preemption:
    """Remembers SIGTERM; the training loop decides when to stop, so a step is never torn."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        if not self.requested:
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


def serialise_state(model, optimizer, step: int, loss: float) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "loss": loss}, buf
    )
    return buf.getvalue()


def train(spec: JobSpec, train_csv: bytes, rank: int, world_size: int, preemption: _Preemption) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hybridflow.datasets import parse_split
    from hybridflow.training.model import build_model

    # Ranks share the machine's cores; more intra-op threads per rank only oversubscribe them.
    torch.set_num_threads(max(1, int(os.environ.get("HYBRIDFLOW_WORKER_THREADS", "1"))))
    x_np, y_np = parse_split(train_csv)
    x, y = torch.tensor(x_np), torch.tensor(y_np)  # copies: pandas may hand back read-only arrays
    store = open_store(StoreSpec.from_dict(spec.checkpoint_store))
    checkpoints = CheckpointStore(store)

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        model = build_model(spec.hidden)
        optimizer = torch.optim.SGD(model.parameters(), lr=spec.learning_rate, momentum=spec.momentum)

        # Rank 0 picks the checkpoint and tells the others, so every rank resumes from the same step
        # even if a checkpoint lands (or is pruned) while they are looking.
        chosen = [None]
        if rank == 0:
            latest = checkpoints.latest()
            chosen = [latest.step if latest else 0]
        dist.broadcast_object_list(chosen, src=0)
        start_step = int(chosen[0])
        final_loss = float("nan")
        if start_step > 0:
            ckpt = latest if rank == 0 else checkpoints.load(start_step)
            state = torch.load(io.BytesIO(ckpt.payload), weights_only=True)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            final_loss = float(state.get("loss", final_loss))
            log.info("resuming from checkpoint step %d (%s)", start_step, store.uri)
        else:
            log.info("no committed checkpoint in %s: starting from step 0", store.uri)

        ddp = DistributedDataParallel(model)
        sampler = StepSampler(len(x), spec.batch_size, rank, world_size, spec.seed)
        loss_fn = torch.nn.CrossEntropyLoss()
        checkpointer = AsyncCheckpointer(checkpoints, spec.keep) if rank == 0 else None
        last_saved = start_step
        last_save_time = time.monotonic()
        started = time.monotonic()
        window_start, window_steps = started, 0
        step = start_step
        preempted = False

        def checkpoint(at: int, loss: float) -> None:
            nonlocal last_saved, last_save_time
            if checkpointer is not None and at > last_saved:
                checkpointer.submit(
                    at, serialise_state(model, optimizer, at, loss), {"loss": loss, "run_key": spec.run_key}
                )
            last_saved, last_save_time = at, time.monotonic()

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
                due_by_time = (
                    spec.checkpoint_every_seconds is not None
                    and time.monotonic() - last_save_time >= spec.checkpoint_every_seconds
                )
                if step % spec.checkpoint_every_steps == 0 or due_by_time:
                    checkpoint(step, final_loss)

            # A final checkpoint at the last completed step: on preemption it is the resume point;
            # at the end it makes a rerun of a finished run a no-op.
            checkpoint(step, final_loss)
            if checkpointer is not None:
                checkpointer.flush()
        finally:
            if checkpointer is not None:
                checkpointer.close()
        train_seconds = time.monotonic() - started

        if preempted:
            log.warning(
                "preempted after step %d; checkpoint committed, exiting %d", step, PREEMPTED_EXIT_CODE
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
                "final_loss": final_loss,
                "train_seconds": round(train_seconds, 3),
                "world_size": world_size,
            }
            store.put_bytes(RESULT_KEY, json.dumps(result, indent=2, sort_keys=True).encode())
            log.info("training done: %s", json.dumps(result, sort_keys=True))
        # Nobody leaves before rank 0 has committed, so the launcher never sees a peer's exit and
        # SIGTERMs rank 0 in the middle of its final upload.
        dist.barrier()
        return PREEMPTED_EXIT_CODE if preempted else 0
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, type=Path, help="job.json written by the launcher")
    args = parser.parse_args(argv)

    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank{rank} %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    preemption = _Preemption()
    preemption.install()
    try:
        spec = JobSpec.from_dict(json.loads(args.spec.read_text()))
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
