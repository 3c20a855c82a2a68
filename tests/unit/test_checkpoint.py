"""Checkpoint commit protocol and background checkpointing: only committed, verified checkpoints
are ever loaded, from either of a run's two places, and the training thread only takes a snapshot."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest
import torch

from hybridflow.storage.objectstore import LocalObjectStore
from hybridflow.training.checkpoint import MANIFEST_NAME, CheckpointStore, latest_of, step_prefix
from hybridflow.training.checkpointer import AsyncCheckpointer, StateSnapshot, torch_deserialise


@pytest.fixture
def store(tmp_path):
    return LocalObjectStore(tmp_path / "ckpt")


def _two(step: int) -> dict[str, bytes]:
    return {"model.pt": f"model-{step}".encode(), "optimizer.pt": f"optim-{step}".encode()}


def test_save_then_latest_round_trips_every_shard(store):
    cs = CheckpointStore(store)
    assert cs.latest() is None
    cs.save(10, _two(10), {"loss": 1.5})
    cs.save(20, _two(20), {"loss": 0.5})

    latest = cs.latest()
    assert latest is not None
    assert (latest.step, latest.shards, latest.meta) == (20, _two(20), {"loss": 0.5})
    assert cs.committed_steps() == [10, 20]
    manifest = json.loads(store.get_bytes(f"{step_prefix(20)}/{MANIFEST_NAME}"))
    assert manifest["format"] == "hybridflow.checkpoint/v2" and manifest["step"] == 20
    assert [(s["name"], s["size"]) for s in manifest["shards"]] == [("model.pt", 8), ("optimizer.pt", 8)]
    assert all(len(s["sha256"]) == 64 for s in manifest["shards"])


def test_shards_without_manifest_are_never_loaded(store, caplog):
    cs = CheckpointStore(store)
    cs.save(10, _two(10))
    # A worker killed after both shards of step 20 but before its manifest.
    for name, data in _two(20).items():
        store.put_bytes(f"{step_prefix(20)}/{name}", data)

    with caplog.at_level(logging.INFO, logger="hybridflow.training.checkpoint"):
        latest = cs.latest()
    assert latest is not None and latest.step == 10 and latest.shards == _two(10)
    assert cs.committed_steps() == [10]
    assert "step 20" in caplog.text and "not committed" in caplog.text


def test_only_partial_checkpoints_means_start_from_scratch(store):
    store.put_bytes(f"{step_prefix(5)}/model.pt", b"partial")
    assert CheckpointStore(store).latest() is None


def test_any_shard_with_wrong_sha_makes_the_checkpoint_unloadable(store, caplog):
    cs = CheckpointStore(store)
    cs.save(10, _two(10))
    cs.save(20, _two(20))
    # Same size, different bytes, in the second shard only: only its SHA-256 can tell.
    store.put_bytes(f"{step_prefix(20)}/optimizer.pt", b"evil-020")

    with caplog.at_level(logging.WARNING, logger="hybridflow.training.checkpoint"):
        latest = cs.latest()
    assert latest is not None and latest.step == 10
    assert "checkpoint step 20" in caplog.text and "shard optimizer.pt" in caplog.text
    with pytest.raises(ValueError, match="corrupt: shard optimizer.pt"):
        cs.load(20)


def test_missing_shard_or_bad_manifest_is_skipped(store):
    cs = CheckpointStore(store)
    for step in (10, 20, 30, 40):
        cs.save(step, _two(step))
    store.delete(f"{step_prefix(40)}/model.pt")
    store.put_bytes(f"{step_prefix(30)}/{MANIFEST_NAME}", b"{not json")
    store.put_bytes(f"{step_prefix(20)}/{MANIFEST_NAME}", json.dumps({"format": "other", "step": 20}).encode())
    assert cs.latest().step == 10
    with pytest.raises(ValueError, match="shard model.pt is missing"):
        cs.load(40)
    with pytest.raises(ValueError, match="bad manifest"):
        cs.load(20)


def test_resaving_a_step_replaces_it_consistently(store):
    cs = CheckpointStore(store)
    cs.save(10, {"model.pt": b"first"})
    cs.save(10, {"model.pt": b"second, longer"})
    assert cs.latest().shards == {"model.pt": b"second, longer"}


@pytest.mark.parametrize("name", ["", ".hidden", MANIFEST_NAME, "a/b", "x" * 200])
def test_bad_shard_names_are_refused(store, name):
    with pytest.raises(ValueError, match="shard name"):
        CheckpointStore(store).save(1, {name: b"x"})


def test_prune_keeps_newest_and_removes_abandoned_partials(store):
    cs = CheckpointStore(store)
    for step in (10, 20, 30, 40, 50):
        cs.save(step, _two(step))
    store.put_bytes(f"{step_prefix(15)}/model.pt", b"abandoned")  # older than the newest commit
    store.put_bytes(f"{step_prefix(60)}/model.pt", b"in flight")  # newer: maybe still being written

    deleted = cs.prune(keep=2)

    assert sorted(deleted) == [10, 15, 20, 30]
    assert cs.committed_steps() == [40, 50]
    assert store.exists(f"{step_prefix(60)}/model.pt")
    assert not list(store.list(step_prefix(10)))  # every shard went, not only the manifest
    assert cs.latest().step == 50


def test_prune_sweeps_temp_files_of_writes_killed_mid_way(store):
    cs = CheckpointStore(store)
    cs.save(10, _two(10))
    folder = store.root / step_prefix(10)
    stale, fresh = folder / ".model.pt.k1ll3d.part", folder / ".optimizer.pt.wr1t1ng.part"
    stale.write_bytes(b"x" * 1000)
    fresh.write_bytes(b"y" * 1000)
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))

    cs.prune(keep=3)

    assert not stale.exists()  # left by a SIGKILL long ago: invisible to listings, so swept here
    assert fresh.exists()  # may be a write still in flight
    assert cs.latest().step == 10


def test_prune_does_not_count_a_truncated_newest_commit(store):
    cs = CheckpointStore(store)
    cs.save(10, _two(10))
    cs.save(20, _two(20))
    store.put_bytes(f"{step_prefix(20)}/optimizer.pt", b"trunc")  # size no longer matches the manifest

    cs.prune(keep=1)

    # The last good checkpoint survives; the broken newer one is left for inspection.
    assert cs.latest().step == 10
    assert cs.committed_steps() == [10, 20]


class _Unreachable(LocalObjectStore):
    def list(self, prefix=""):
        raise ConnectionError("endpoint down")


def test_latest_of_takes_the_newest_that_verifies_in_either_place(tmp_path, caplog):
    primary = CheckpointStore(LocalObjectStore(tmp_path / "cache"))
    replica = CheckpointStore(LocalObjectStore(tmp_path / "private"))
    for step in (10, 20):
        primary.save(step, _two(step))
        replica.save(step, _two(step))
    primary.save(30, _two(30))  # committed to the primary, not yet replicated

    ckpt, where = latest_of([primary, replica])
    assert (ckpt.step, where) == (30, 0)

    # A corrupt newest copy in the primary: the same step is not elsewhere, so step 20 from the
    # primary (the earlier place wins a tie) is next.
    primary.store.put_bytes(f"{step_prefix(30)}/model.pt", b"model-0xx")
    assert latest_of([primary, replica])[0].step == 20

    # The cache bucket lost everything: resume from private storage.
    for info in list(primary.store.list("")):
        primary.store.delete(info.key)
    ckpt, where = latest_of([primary, replica])
    assert (ckpt.step, where, ckpt.shards) == (20, 1, _two(20))

    # A place that cannot even be listed is skipped with a warning naming it.
    down = CheckpointStore(_Unreachable(tmp_path / "down"))
    with caplog.at_level(logging.WARNING, logger="hybridflow.training.checkpoint"):
        ckpt, where = latest_of([down, replica])
    assert (ckpt.step, where) == (20, 1)
    assert "cannot list checkpoints" in caplog.text and "endpoint down" in caplog.text
    assert latest_of([down]) is None


def test_state_snapshot_reuses_buffers_and_copies_values():
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    state = {"model": {"w": w}, "optimizer": {"param_groups": [{"lr": 0.1, "params": [0]}]}}
    snap = StateSnapshot()

    first = snap.take(state)
    ptr = first["model"]["w"].data_ptr()
    w.add_(100)
    state["optimizer"]["param_groups"][0]["lr"] = 0.5
    assert first["model"]["w"][0, 0].item() == 0.0  # a copy, not a view of the live tensor
    assert first["optimizer"]["param_groups"][0]["lr"] == 0.1

    second = snap.take(state)
    assert second["model"]["w"].data_ptr() == ptr  # the same buffer, refilled
    assert second["model"]["w"][0, 0].item() == 100.0
    assert snap.nbytes == w.numel() * 4
    bigger = snap.take({"model": {"w": torch.zeros(4, 4)}})
    assert bigger["model"]["w"].shape == (4, 4)


class _GatedStore(LocalObjectStore):
    """A store whose shard writes block until released, to observe the background thread."""

    def __init__(self, root):
        super().__init__(root)
        self.gate = threading.Event()
        self.writing = threading.Event()
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()

    def put_bytes(self, key, data, *, metadata=None):
        if not key.endswith(MANIFEST_NAME):
            with self._lock:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.writing.set()
            self.gate.wait(10)
            with self._lock:
                self.in_flight -= 1
        super().put_bytes(key, data, metadata=metadata)


def test_async_checkpointer_snapshots_then_writes_both_places_in_background(tmp_path):
    primary = _GatedStore(tmp_path / "cache")
    replica = LocalObjectStore(tmp_path / "private")
    weights = torch.full((256, 256), 1.0)
    ckpt = AsyncCheckpointer(primary, keep=2, replica=replica)

    started = time.monotonic()
    assert ckpt.offer(1, {"model.pt": {"w": weights}}, {"loss": 1.0})
    assert time.monotonic() - started < 1.0  # the caller was not held up by the write
    assert primary.writing.wait(5)
    weights.add_(1.0)  # training goes on while the write is in flight
    assert not ckpt.offer(2, {"model.pt": {"w": weights}})  # declined, not queued, not waited for
    assert ckpt.declined == 1 and ckpt.written == 0

    # save() waits for the write in flight (final and preemption checkpoints).
    saved = threading.Event()
    t = threading.Thread(target=lambda: (ckpt.save(3, lambda: {"model.pt": {"w": weights}}), saved.set()))
    t.start()
    assert not saved.wait(0.3)
    primary.gate.set()
    assert saved.wait(5)
    t.join()
    assert ckpt.wait(timeout=10)
    weights.add_(1.0)
    assert ckpt.offer(4, {"model.pt": {"w": weights}})  # idle again: taken at once
    ckpt.close()

    assert primary.max_in_flight == 1
    for place in (primary, replica):
        cs = CheckpointStore(place)
        assert cs.committed_steps() == [3, 4]  # 1 pruned to keep=2 in both places; 2 was never taken
        assert torch_deserialise(cs.load(3).shards["model.pt"])["w"][0, 0].item() == 2.0
        assert torch_deserialise(cs.load(4).shards["model.pt"])["w"][0, 0].item() == 3.0
    summary = ckpt.summary()
    assert summary["written"] == 3 and summary["declined_offers"] == 1
    assert summary["bytes_last"] > 256 * 256 * 4
    # Offers only copied tensors; save(3) also waited for step 1's write, and says so.
    history = {h["step"]: h for h in summary["history"]}
    assert history[1]["blocked_s"] < 0.5 and history[4]["blocked_s"] < 0.5
    assert history[3]["waited_s"] >= 0.3 and history[3]["blocked_s"] >= history[3]["waited_s"]


def test_snapshot_taken_at_offer_is_what_gets_committed(tmp_path):
    primary = _GatedStore(tmp_path / "cache")
    weights = torch.zeros(64)
    ckpt = AsyncCheckpointer(primary, keep=5, replica=LocalObjectStore(tmp_path / "private"))
    assert ckpt.offer(7, {"model.pt": {"w": weights}, "optimizer.pt": {"step": 7}})
    assert primary.writing.wait(5)
    weights.fill_(9.0)  # the live tensor changes while the shard is being written
    primary.gate.set()
    ckpt.close()

    for root in ("cache", "private"):
        loaded = CheckpointStore(LocalObjectStore(tmp_path / root)).load(7)
        assert torch_deserialise(loaded.shards["model.pt"])["w"].abs().sum().item() == 0.0
        assert torch_deserialise(loaded.shards["optimizer.pt"]) == {"step": 7}
    assert ckpt.last_step == 7 and ckpt.primary_step == 7


class _FailingStore(LocalObjectStore):
    def put_bytes(self, key, data, *, metadata=None):
        if not key.endswith(MANIFEST_NAME):
            raise OSError("disk full")
        super().put_bytes(key, data, metadata=metadata)


@pytest.mark.parametrize("broken", ["primary", "replica"])
def test_async_checkpointer_reraises_write_errors(tmp_path, broken):
    good, bad = LocalObjectStore(tmp_path / "good"), _FailingStore(tmp_path / "bad")
    primary, replica = (bad, good) if broken == "primary" else (good, bad)
    ckpt = AsyncCheckpointer(primary, keep=1, replica=replica)
    ckpt.offer(1, {"model.pt": {"w": torch.ones(2)}})
    with pytest.raises(OSError, match="disk full"):
        ckpt.wait()
    ckpt.offer(2, {"model.pt": {"w": torch.ones(2)}})
    with pytest.raises(OSError, match="disk full"):
        ckpt.close()
    assert ckpt.written == 0
    assert CheckpointStore(replica).committed_steps() == []  # never replicated what failed
