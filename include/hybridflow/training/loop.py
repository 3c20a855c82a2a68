"""What a training loop leans on in every rank: SIGTERM remembered until the step ends
(:class:`Preemption`), and batches that depend only on the step (:class:`StepSampler`), so a
resumed run sees exactly the rows an uninterrupted one would have."""

from __future__ import annotations

import logging
import signal
import time

log = logging.getLogger("hybridflow.training")


class Preemption:
    """Remembers SIGTERM; the training function decides when to stop, so a step is never torn."""

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


class StepSampler:
    """Deterministic sharding by step: epoch e is a permutation seeded by (seed, e); step s takes the
    next global batch from it and rank r every world_size-th row of that batch. A run resumed at step
    k sees exactly the rows an uninterrupted run would have."""

    def __init__(self, n: int, batch_size: int, rank: int, world_size: int, seed: int) -> None:
        import torch

        self._torch = torch
        self.global_batch = batch_size * world_size
        if n < self.global_batch:
            raise ValueError(f"{n} training rows cannot fill one global batch of {self.global_batch} "
                             f"({batch_size} per rank x {world_size} ranks); lower batch_size")
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
