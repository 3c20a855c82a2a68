"""The training contract: what a registered model's ``train(ctx)`` is given in every rank of its gang.

::

    def train(ctx):
        frame = ctx.dataset.split("train").frame()          # every file checked against its SHA-256
        model = ctx.wrap(build(ctx.hparams))                # on ctx.device, DDP or FSDP (the sharding Param)
        optimizer = ctx.optimizer(model, lr=...)            # the optimizer Param's (ZeRO-1 shards it)
        start = ctx.restore(model, optimizer)               # newest good checkpoint's step, or 0
        sampler = ctx.sampler(len(frame), ctx.hparams["batch_size"])
        for step in range(start + 1, ctx.hparams["steps"] + 1):
            with ctx.autocast():                            # the precision Param
                loss = ...                                  # one step on sampler.indices(step), on ctx.device
            ctx.backward(loss); ctx.step(optimizer)         # GradScaler for fp16
            ctx.log(step, loss=loss.item())                  # task log and run record
            if ctx.should_stop():                            # preempted (spot reclaim, eviction): leave
                break
            if ctx.checkpoint.due(step):
                ctx.save_checkpoint(step, model, optimizer)  # whole from rank 0, or every rank's part
        ctx.save_checkpoint(step, model, optimizer)          # the resume point, or a finished run's last
        ctx.save_model(model)                                # the whole weights become the trained model

The helpers (:mod:`hybridflow.training.parallel`) apply the run's precision, optimizer and sharding;
code that does its own wrapping uses ``ctx.checkpoint`` directly.
``ctx.checkpoint.save`` takes the whole state from rank 0 (each top-level key is one shard);
``save_sharded`` / ``restore_sharded`` save and load every rank's part with
``torch.distributed.checkpoint``. Either way a checkpoint is written in the background to the run's
two places and only exists once its manifest is committed. The platform owns exit codes: a
preempted gang that left through ``should_stop`` exits 75 once its last checkpoint is committed
(within the grace period) and is relaunched to resume; an exception is an application failure
(its traceback in the task log) and uses the task's Airflow retries.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.gpumem import TrainSetting
from hybridflow.training.checkpoint import CheckpointStore, latest_of
from hybridflow.training.loop import Preemption, StepSampler  # noqa: F401 - part of the contract's surface

log = logging.getLogger("hybridflow.training")

# EX_TEMPFAIL: the worker stopped on SIGTERM (spot reclaim, cancel, launcher death) after
# checkpointing; the run is resumable, so callers should retry rather than treat it as a bug.
PREEMPTED_EXIT_CODE = 75
FINAL_MODEL_KEY = "model/final.pt"
RESULT_KEY = "result.json"
# Points kept per scalar in the run record: enough for a curve, bounded for long runs.
MAX_SERIES_POINTS = 200


def attempt_status_key(attempt: str) -> str:
    """Where a gang reports one attempt (start step, last step, outcome) in the primary place."""
    return f"attempts/{attempt}.json"


@dataclass(frozen=True)
class Restored:
    """A committed checkpoint, verified, as the training function saved it."""

    step: int
    state: dict[str, Any]
    meta: dict[str, Any]


@dataclass(frozen=True)
class CheckpointPolicy:
    every_steps: int
    every_seconds: float | None
    keep: int
    grace_s: float


class CheckpointHandle:
    """``ctx.checkpoint``: restore the newest good checkpoint, save new ones in the background."""

    def __init__(self, places: list[CheckpointStore], policy: CheckpointPolicy, *, rank: int, world_size: int,
                 preemption: Preemption, workdir: Path, meta: Callable[[], dict],
                 progress: Callable[[], int | None] | None = None,
                 on_restore: Callable[[int], None] | None = None) -> None:
        self.places = places
        self._on_restore = on_restore  # the worker reports the resume point as soon as it is chosen
        self.policy = policy
        self.rank, self.world_size = rank, world_size
        self._preemption = preemption
        self._workdir = workdir
        self._meta = meta
        self._progress = progress  # the newest step trained (ctx.last_step)
        self._full = None  # AsyncCheckpointer, rank 0 only
        self._sharded = None  # ShardedCheckpointer, every rank
        self.mode: str | None = None  # "full" or "sharded", from the first save
        self.restored_step = 0
        self.saved_step: int | None = None  # newest step handed over for saving
        self._owed = False  # due while the previous checkpoint was still being written
        self.declined = 0  # steps a due checkpoint waited for the previous one to commit
        self._last_save = time.monotonic()
        self.timer_due_shared = False  # rank 0's timer, as should_stop() shared it with every rank
        # Whether rank 0 was still writing a full-state checkpoint, as should_stop() shared it; with
        # a collective full save (ZeRO-1 gathers the optimizer state on rank 0) every rank must answer
        # due() alike, so they all go by it instead of rank 0's own writer.
        self.busy_shared = False
        self.collective_full = False

    # -- restoring -------------------------------------------------------------------------------
    def _choose(self) -> tuple[int, int, str]:
        """(step, place index, kind) of the checkpoint every rank resumes from; rank 0 decides, so a
        checkpoint landing while ranks look cannot split the gang."""
        import torch.distributed as dist

        chosen: list = [None]
        self._found = None
        if self.rank == 0:
            found = latest_of(self.places)
            self._found = found
            if found is None:
                chosen = [(0, 0, "")]
            else:
                kind = "sharded" if found[0].meta.get("kind") == "sharded" else "full"
                chosen = [(found[0].step, found[1], kind)]
        dist.broadcast_object_list(chosen, src=0)
        step, index, kind = chosen[0]
        if step:
            log.info("resuming from checkpoint step %d (%s, %s)", step, self.places[index].uri, kind)
        else:
            log.info("no committed checkpoint in %s: starting from step 0", ", ".join(p.uri for p in self.places))
        self.restored_step = int(step)
        if self._on_restore is not None:
            # Reported now, not at the end: an attempt killed outright still says where it started.
            self._on_restore(self.restored_step)
        # The checkpoint timer counts training time from here: reading the data and building the
        # model before the restore is not time a checkpoint would save, and counting it would make
        # the first training step always due.
        self._last_save = time.monotonic()
        return int(step), int(index), kind

    def restore(self) -> Restored | None:
        """The newest committed checkpoint that verifies in either place, saved with :meth:`save`
        (collective: call it on every rank). None when the run has none yet."""
        from hybridflow.training.checkpointer import torch_deserialise

        step, index, kind = self._choose()
        if not step:
            return None
        if kind == "sharded":
            raise RuntimeError(f"checkpoint step {step} was saved sharded (sharding zero2/zero3, or save_sharded): "
                               "resume with the sharding it was saved with, or restore it with "
                               "ctx.checkpoint.restore_sharded(state)")
        ckpt = self._found[0] if self.rank == 0 else self.places[index].load(step)
        state = {Path(name).stem: torch_deserialise(data) for name, data in ckpt.shards.items()}
        self.saved_step = step
        return Restored(step=step, state=state, meta=dict(ckpt.meta))

    def restore_sharded(self, state: dict[str, Any]) -> int | None:
        """Load the newest committed sharded checkpoint into ``state`` in place (every rank its own
        part, through ``torch.distributed.checkpoint``); returns its step, or None when there is none."""
        from hybridflow.training.sharded import load_sharded

        step, index, kind = self._choose()
        if not step:
            return None
        if kind != "sharded":
            raise RuntimeError(f"checkpoint step {step} holds the whole state from rank 0 (sharding none/zero1, "
                               "or save): resume with the sharding it was saved with, or restore it with "
                               "ctx.checkpoint.restore()")
        found = self._found[0] if self.rank == 0 and self._found else None  # read and verified already
        load_sharded(self.places[index], step, state, self._workdir / "restore", checkpoint=found)
        self.saved_step = step
        return step

    # -- saving ----------------------------------------------------------------------------------
    def _timer_due(self) -> bool:
        every = self.policy.every_seconds
        if every is None:
            return False
        if (self.mode != "full" or self.collective_full) and self.world_size > 1:
            # A sharded save (and ZeRO-1's, which gathers on rank 0) is collective, so every rank
            # must agree: only rank 0's timer as should_stop() shared it counts. That holds before
            # the first save too, while the kind of checkpoint is not known yet (ranks' own clocks
            # cross the interval at different steps).
            return self.timer_due_shared
        return time.monotonic() - self._last_save >= every

    @property
    def writing(self) -> bool:
        """Rank 0's full-state writer is still busy with the previous checkpoint."""
        return self._full is not None and self._full.busy

    def local_timer_due(self) -> bool:
        every = self.policy.every_seconds
        return every is not None and time.monotonic() - self._last_save >= every

    def due(self, step: int) -> bool:
        """Whether to checkpoint after ``step``: every ``checkpoint_every_steps`` steps, on the
        interruptible runs' timer, or still owed because the last one was declined. While rank 0 is
        still writing the previous full-state checkpoint it answers False (training never waits for
        storage) and asks again at the next step."""
        if not (self._owed or step % self.policy.every_steps == 0 or self._timer_due()):
            return False
        busy = self.busy_shared if self.collective_full else self._full is not None and self._full.busy
        if self.mode != "sharded" and busy:
            self._owed = True
            self.declined += 1
            return False
        return True

    def _deadline_left(self) -> float | None:
        if not self._preemption.requested:
            return None
        margin = min(2.0, 0.1 * self.policy.grace_s)  # leave time to log and exit before SIGKILL
        return max(0.0, self._preemption.at + self.policy.grace_s - margin - time.monotonic())

    def save(self, step: int, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]]) -> None:
        """Checkpoint the whole state at ``step`` from rank 0 (other ranks return at once): the
        tensors are copied now, serialised and committed to both places in the background. ``state``
        maps names (letters, numbers, ``.``, ``_``, ``-``) to nested dicts of tensors, or is a callable
        returning that mapping. Waits for the previous checkpoint if it is still being written."""
        from hybridflow.training.checkpointer import AsyncCheckpointer

        self._mark("full")
        if self.saved_step == step:
            return  # already saved (e.g. the final save right after a due one)
        self.saved_step, self._owed, self._last_save = step, False, time.monotonic()
        if self.rank != 0:
            return
        if self._full is None:
            # progress: the step training has reached when a write commits, so each commit reports
            # its in-flight window (steps trained between snapshot and commit).
            self._full = AsyncCheckpointer(self.places[0], self.policy.keep,
                                           replica=self.places[1] if len(self.places) > 1 else None,
                                           progress=self._steps_trained)
        left = self._deadline_left()
        if left is not None and not self._full.wait(timeout=left):
            _give_up_in_grace(step, self.policy.grace_s)
        shards = state() if callable(state) else state
        self._full.save(step, {f"{name}.pt": tree for name, tree in shards.items()}, self._meta())

    def save_sharded(self, step: int, state: Mapping[str, Any]) -> None:
        """Checkpoint ``state`` at ``step`` with ``torch.distributed.checkpoint``, every rank writing
        its own part (collective: call it on every rank with the same step). Committed to both
        places in the background once every rank's part is stored."""
        from hybridflow.training.sharded import ShardedCheckpointer

        self._mark("sharded")
        if self.saved_step == step:
            return
        self.saved_step, self._owed, self._last_save = step, False, time.monotonic()
        self.timer_due_shared = False
        if self._sharded is None:
            self._sharded = ShardedCheckpointer(
                self.places[0], self.places[1] if len(self.places) > 1 else None, rank=self.rank,
                world_size=self.world_size, keep=self.policy.keep, workdir=self._workdir / "sharded",
            )
        left = self._deadline_left()
        if left is not None and not self._sharded.wait(timeout=left):
            _give_up_in_grace(step, self.policy.grace_s)
        self._sharded.save(step, dict(state), self._meta())

    def _steps_trained(self) -> int:
        step = self._progress() if self._progress is not None else None
        return step if step is not None else (self.saved_step or 0)

    def _mark(self, mode: str) -> None:
        if self.mode not in (None, mode):
            raise RuntimeError(f"this run saves {self.mode} checkpoints; use one kind of save in a run")
        self.mode = mode

    # -- the end ---------------------------------------------------------------------------------
    @property
    def _writer(self):
        return self._full if self.mode == "full" else self._sharded

    def finish(self) -> float | None:
        """Wait until the last checkpoint is committed; when preempted, only within the grace period
        (then exit 75 at once: the newest committed checkpoint is the resume point). Returns the
        seconds from SIGTERM to the commit when preempted."""
        writer = self._writer
        if writer is None:
            return None
        if not writer.wait(timeout=self._deadline_left()):
            _give_up_in_grace(self.saved_step, self.policy.grace_s)
        writer.close()
        return round(time.monotonic() - self._preemption.at, 3) if self._preemption.requested else None

    @property
    def committed_step(self) -> int | None:
        writer = self._writer
        return writer.primary_step if writer is not None else None

    def summary(self) -> dict:
        writer = self._writer
        out = writer.summary() if writer is not None else {"written": 0}
        return {**out, "declined_offers": self.declined}


def _give_up_in_grace(step: int | None, grace_s: float) -> None:
    log.error(
        "checkpoint step %s not committed within the %gs grace period; the retry resumes from the newest "
        "earlier checkpoint (raise training.preemption_grace_s if this repeats)", step, grace_s,
    )
    logging.shutdown()
    # The upload thread may be stuck in storage I/O; a normal exit would join it past the SIGKILL.
    os._exit(PREEMPTED_EXIT_CODE)


class TrainingContext:
    """What ``train(ctx)`` gets. Attributes: ``rank``, ``world_size``, ``device``, ``run_key``, ``model``
    (its registered name), ``hparams`` (the run's hyper-parameters), ``dataset``, ``checkpoint``.

    ``device`` is where the training function puts its model and batches: ``"cuda:<local rank>"`` when
    the rank has a GPU (the gang then talks NCCL), else ``"cpu"`` (gloo); see
    :mod:`hybridflow.training.device`."""

    def __init__(self, *, rank: int, world_size: int, run_key: str, model: str, hparams: Mapping[str, Any],
                 dataset, checkpoint: CheckpointHandle, preemption: Preemption, store,
                 log_every_steps: int = 50, inject_failure: Mapping[str, int] | None = None,
                 device: str = "cpu", setting: TrainSetting | None = None) -> None:
        from hybridflow.training.parallel import Parallel

        self.rank, self.world_size, self.run_key, self.model = rank, world_size, run_key, model
        self.setting = setting or TrainSetting()
        self.parallel = Parallel(self.setting, device, rank, world_size)
        self.hparams: dict[str, Any] = dict(hparams)
        self.dataset = dataset
        self.checkpoint = checkpoint
        self.device = device
        self._preemption = preemption
        self._store = store
        self._log_every = max(1, int(log_every_steps))
        self._inject = dict(inject_failure or {})
        self.stopping = False  # should_stop() answered True
        self.model_saved = False
        self.last_step: int | None = None
        self.metrics: dict[str, list[tuple[int, float]]] = {}
        self._window = (time.monotonic(), 0)
        self.last_logged: int | None = None
        # (first step logged, when, last step logged, when): the training loop's own pace, without
        # data loading, restore or the last checkpoint (rank 0).
        self.loop: tuple[int, float, int, float] | None = None

    # -- the run's precision, optimizer and sharding (hybridflow.training.parallel) --------------
    def wrap(self, module):
        """``module`` on ``ctx.device``, wrapped for the run's ``sharding`` (DDP or FSDP2)."""
        return self.parallel.wrap(module)

    def optimizer(self, module, *, lr: float, momentum: float = 0.9, weight_decay: float = 0.0):
        """The run's ``optimizer`` over ``module`` (sharded for ``zero1``)."""
        if self.setting.sharding == "zero1":
            self.checkpoint.collective_full = True
        return self.parallel.optimizer(module, lr=lr, momentum=momentum, weight_decay=weight_decay)

    def autocast(self):
        """The forward pass in the run's ``precision`` (``with ctx.autocast(): loss = ...``)."""
        return self.parallel.autocast()

    def backward(self, loss) -> None:
        """``loss.backward()``, scaled for fp16."""
        self.parallel.backward(loss)

    def step(self, optimizer) -> None:
        """The optimizer step (unscaled for fp16, skipped on overflow), then gradients cleared."""
        self.parallel.step(optimizer)

    def restore(self, module, optimizer) -> int:
        """Load the newest committed checkpoint into ``module`` and ``optimizer`` (the wrapped ones),
        whole or sharded as the run's ``sharding`` saves them; its step, 0 when there is none.
        Collective: call it on every rank."""
        if self.parallel.sharded_checkpoints:
            state = self.parallel.state(module, optimizer)  # the shapes every rank's part loads into
            step = self.checkpoint.restore_sharded(state)
            if step is not None:
                self.parallel.load(module, optimizer, state)
            return step or 0
        restored = self.checkpoint.restore()
        if restored is None:
            return 0
        self.parallel.load(module, optimizer, restored.state)
        return restored.step

    def save_checkpoint(self, step: int, module, optimizer) -> None:
        """Checkpoint ``module`` and ``optimizer`` at ``step`` (collective: every rank, the same step)."""
        if self.checkpoint.saved_step == step:
            return  # already saved (every rank agrees: they saved the same steps)
        if self.parallel.sharded_checkpoints:
            self.checkpoint.save_sharded(step, self.parallel.state(module, optimizer))
        elif self.setting.sharding == "zero1":
            self.checkpoint.save(step, self.parallel.state(module, optimizer))  # gathered on rank 0
        else:
            self.checkpoint.save(step, lambda: self.parallel.state(module, optimizer))

    @property
    def preempted(self) -> bool:
        """This rank received SIGTERM (spot reclaim, eviction, cancel). Prefer :meth:`should_stop`,
        which all ranks answer alike."""
        return self._preemption.requested

    def should_stop(self) -> bool:
        """True on every rank once any rank was asked to stop: leave the training loop, save the last
        checkpoint and return. Collective (one tiny all-reduce): call it on every rank, once a step."""
        import torch
        import torch.distributed as dist

        # NCCL reduces only tensors on the rank's GPU; gloo those on CPU.
        flags = torch.tensor([1.0 if self._preemption.requested else 0.0,
                              1.0 if self.rank == 0 and self.checkpoint.local_timer_due() else 0.0,
                              1.0 if self.rank == 0 and self.checkpoint.writing else 0.0], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self.checkpoint.timer_due_shared = bool(flags[1].item() > 0)
        self.checkpoint.busy_shared = bool(flags[2].item() > 0)
        self.stopping = bool(flags[0].item() > 0)
        return self.stopping

    def sampler(self, n: int, batch_size: int, seed: int = 0) -> StepSampler:
        """Which of ``n`` rows this rank trains on at each step (see :class:`StepSampler`)."""
        return StepSampler(n, int(batch_size), self.rank, self.world_size, int(seed))

    def log(self, step: int, **scalars: float) -> None:
        """Record this step's scalars (``loss=...`` and any others). Rank 0's values go to the task log
        every ``log_every_steps`` steps and to the run record; call it on every rank."""
        fault = self._inject
        if fault and int(fault.get("rank", -1)) == self.rank and int(fault.get("step", -1)) == step:
            raise RuntimeError(f"injected failure on rank {self.rank} at step {step}")
        self.last_step = step
        if self.rank != 0:
            return
        for name, value in scalars.items():
            self.metrics.setdefault(name, []).append((step, float(value)))
        started, steps = self._window
        now = time.monotonic()
        if self.last_logged is None:
            started = now  # the rate counts training steps, not the restore before them
            self.loop = (step, now, step, now)
        else:
            self.loop = (self.loop[0], self.loop[1], step, now)
        self.last_logged = step
        steps += 1
        self._window = (started, steps)
        if step % self._log_every == 0:
            values = " ".join(f"{k} {float(v):.4f}" for k, v in scalars.items())
            log.info("step %d %s %.1f steps/s", step, values, steps / max(now - started, 1e-9))
            self._window = (now, 0)

    def save_model(self, module) -> None:
        """The trained weights (``module``'s whole state dict, gathered on rank 0 when sharded):
        evaluation, compression and serving rebuild the module with the registered builder and load
        them. Call it on every rank. Ignored after a preemption."""
        import io

        import torch

        if self.stopping:
            log.info("preempted: the model is saved when training completes, not now")
            return
        self.model_saved = True
        weights = self.parallel.model_state(module)  # collective for FSDP; None except on rank 0
        if self.rank != 0:
            return
        buf = io.BytesIO()
        torch.save(_on_host(weights), buf)
        self._store.put_bytes(FINAL_MODEL_KEY, buf.getvalue())

    def metrics_summary(self) -> dict:
        """Last value and a bounded series of every scalar logged (rank 0)."""
        out = {}
        for name, points in self.metrics.items():
            stride = max(1, len(points) // MAX_SERIES_POINTS)
            series = points[::stride]
            if series[-1] != points[-1]:
                series.append(points[-1])
            out[name] = {"last": points[-1][1], "last_step": points[-1][0], "series": series}
        return out


def _on_host(state):
    """``state`` with its GPU tensors copied to host memory: evaluation, compression and serving load
    the weights where there may be no GPU. Unchanged (same object) when all of it is on the CPU."""
    import torch

    if not any(isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in state.values()):
        return state
    out = type(state)((k, v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in state.items())
    if hasattr(state, "_metadata"):
        out._metadata = state._metadata  # module versions that load_state_dict reads
    return out


def report_attempt(store, attempt: str, status: dict) -> None:
    store.put_bytes(attempt_status_key(attempt), json.dumps(status, sort_keys=True).encode())
