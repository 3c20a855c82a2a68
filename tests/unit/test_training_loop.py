"""The training loop's pieces that run in one process, without a gang: the step sampler that shards
batches and resumes at any step, and the checkpoint handle's timer, writer and in-flight accounting
that every rank of a gang must answer alike."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from hybridflow.storage.objectstore import LocalObjectStore
from hybridflow.training.checkpoint import CheckpointStore


def test_step_sampler_is_deterministic_and_shards_disjointly():
    from hybridflow.training.context import StepSampler

    shards = [StepSampler(1000, 32, rank, 2, seed=3) for rank in range(2)]
    for step in (1, 2, 31, 32, 500):  # 15 steps per epoch: crosses several epochs
        a, b = (s.indices(step).tolist() for s in shards)
        assert len(a) == len(b) == 32 and not set(a) & set(b)
        # A resumed run (fresh sampler jumping straight to ``step``) sees the same batch.
        assert StepSampler(1000, 32, 0, 2, seed=3).indices(step).tolist() == a
    epoch0 = [i for step in range(1, 16) for s in shards for i in s.indices(step).tolist()]
    assert len(set(epoch0)) == len(epoch0)  # no row twice within an epoch
    with pytest.raises(ValueError, match="lower batch_size"):
        StepSampler(63, 32, 0, 2, seed=0)


def _handle(tmp_path: Path, *, rank: int = 0, world_size: int = 1, every_seconds: float):
    from hybridflow.training.context import CheckpointHandle, CheckpointPolicy, Preemption

    policy = CheckpointPolicy(every_steps=10**9, every_seconds=every_seconds, keep=1, grace_s=5.0)
    return CheckpointHandle([CheckpointStore(LocalObjectStore(tmp_path / "ckpt"))], policy, rank=rank,
                            world_size=world_size, preemption=Preemption(), workdir=tmp_path / "work", meta=dict)


def test_checkpoint_timer_counts_from_the_restore(tmp_path, monkeypatch):
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        handle = _handle(tmp_path, every_seconds=1.0)
        time.sleep(1.1)  # the training function reads its data and builds its model
        assert handle.restore() is None  # nothing to resume from
        assert not handle.due(1)  # the first step is not a checkpoint: the interval starts at the restore
        time.sleep(1.05)
        assert handle.due(2)
    finally:
        dist.destroy_process_group()


def test_ranks_of_a_gang_checkpoint_on_rank_0s_timer_until_a_full_state_save(tmp_path):
    handle = _handle(tmp_path, rank=1, world_size=2, every_seconds=0.01)
    time.sleep(0.05)
    assert handle.local_timer_due()
    # The kind of checkpoint is not known before the first save, and a sharded save is collective:
    # this rank's own clock must not start one that rank 0 does not.
    assert not handle.due(1)
    handle.timer_due_shared = True  # rank 0's timer, as should_stop() shares it
    assert handle.due(2)
    # Full-state saves are rank 0's alone (other ranks return at once): its own clock is enough.
    handle.save(2, {})
    handle.timer_due_shared = False
    time.sleep(0.05)
    assert handle.mode == "full" and handle.due(3)


def test_zero1_ranks_go_by_rank_0s_timer_and_writer_even_after_a_full_state_save(tmp_path):
    """ZeRO-1's full-state save gathers the optimizer state on rank 0 (collective): every rank must
    answer due() alike, so each goes by rank 0's timer and writer as should_stop() shared them."""
    handle = _handle(tmp_path, rank=1, world_size=2, every_seconds=0.01)
    handle.collective_full = True
    handle.save(2, {})
    time.sleep(0.05)
    assert handle.mode == "full" and handle.local_timer_due() and not handle.due(3)
    handle.timer_due_shared = True
    assert handle.due(3)
    handle.busy_shared = True  # rank 0 is still writing step 2: every rank declines alike
    assert not handle.due(4) and handle.declined == 1


def test_full_checkpoints_report_the_steps_trained_while_they_were_written(tmp_path):
    import torch

    from hybridflow.training.context import CheckpointHandle, CheckpointPolicy, Preemption

    class GatedStore(LocalObjectStore):
        """Writes wait for the gate: the checkpoint stays in flight while training goes on."""

        gate = threading.Event()

        def put_bytes(self, key, data, **kwargs):
            assert self.gate.wait(30)
            super().put_bytes(key, data, **kwargs)

    trained = {"step": 10}
    policy = CheckpointPolicy(every_steps=10, every_seconds=None, keep=2, grace_s=5.0)
    handle = CheckpointHandle([CheckpointStore(GatedStore(tmp_path / "ckpt"))], policy, rank=0, world_size=1,
                              preemption=Preemption(), workdir=tmp_path / "work", meta=dict,
                              progress=lambda: trained["step"])
    assert handle.due(10)
    handle.save(10, {"model": {"w": torch.ones(4)}})
    assert not handle.due(20) and not handle.due(21)  # still writing: declined, owed
    trained["step"] = 23
    GatedStore.gate.set()
    handle.finish()
    summary = handle.summary()
    assert summary["written"] == 1 and summary["history"][0]["steps_in_flight"] == 13
    assert summary["max_steps_in_flight"] == 13 and handle.committed_step == 10
    assert handle.due(24)  # the checkpoint declined at step 20 is still owed
