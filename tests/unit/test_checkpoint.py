"""Checkpoint commit protocol: only committed, verified checkpoints are ever loaded."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest

from hybridflow.storage.objectstore import LocalObjectStore
from hybridflow.training.checkpoint import AsyncCheckpointer, CheckpointStore, step_prefix


@pytest.fixture
def store(tmp_path):
    return LocalObjectStore(tmp_path / "ckpt")


def test_save_then_latest_round_trips(store):
    cs = CheckpointStore(store)
    assert cs.latest() is None
    cs.save(10, b"state-10", {"loss": 1.5})
    cs.save(20, b"state-20", {"loss": 0.5})

    latest = cs.latest()
    assert latest is not None
    assert (latest.step, latest.payload, latest.meta) == (20, b"state-20", {"loss": 0.5})
    assert cs.committed_steps() == [10, 20]
    record = json.loads(store.get_bytes("step-000000020/COMMITTED.json"))
    assert set(record) >= {"size", "sha256", "step", "time"}
    assert record["size"] == len(b"state-20")


def test_state_without_commit_is_never_loaded(store, caplog):
    cs = CheckpointStore(store)
    cs.save(10, b"good", {})
    # A worker killed between the state upload and the commit record.
    store.put_bytes(f"{step_prefix(20)}/state.pt", b"half-writ")

    with caplog.at_level(logging.INFO, logger="hybridflow.training.checkpoint"):
        latest = cs.latest()
    assert latest is not None and latest.step == 10 and latest.payload == b"good"
    assert cs.committed_steps() == [10]
    assert "step 20: not committed" in caplog.text


def test_only_partial_checkpoints_means_start_from_scratch(store):
    store.put_bytes(f"{step_prefix(5)}/state.pt", b"partial")
    assert CheckpointStore(store).latest() is None


def test_commit_with_wrong_sha_is_skipped(store, caplog):
    cs = CheckpointStore(store)
    cs.save(10, b"good-state", {})
    cs.save(20, b"good-state", {})
    # Same size, different bytes: only the SHA-256 can tell.
    store.put_bytes(f"{step_prefix(20)}/state.pt", b"evil-state")

    with caplog.at_level(logging.WARNING, logger="hybridflow.training.checkpoint"):
        latest = cs.latest()
    assert latest is not None and latest.step == 10
    assert "checkpoint step 20 is corrupt" in caplog.text
    with pytest.raises(ValueError, match="corrupt"):
        cs.load(20)


def test_commit_with_missing_state_or_bad_record_is_skipped(store):
    cs = CheckpointStore(store)
    cs.save(10, b"ten", {})
    cs.save(20, b"twenty", {})
    cs.save(30, b"thirty", {})
    store.delete(f"{step_prefix(30)}/state.pt")
    store.put_bytes(f"{step_prefix(20)}/COMMITTED.json", b"{not json")
    assert cs.latest().step == 10


def test_resaving_a_step_replaces_it_consistently(store):
    cs = CheckpointStore(store)
    cs.save(10, b"first", {})
    cs.save(10, b"second, longer", {})
    assert cs.latest().payload == b"second, longer"


def test_prune_keeps_newest_and_removes_abandoned_partials(store):
    cs = CheckpointStore(store)
    for step in (10, 20, 30, 40, 50):
        cs.save(step, f"s{step}".encode(), {})
    store.put_bytes(f"{step_prefix(15)}/state.pt", b"abandoned")  # older than the newest commit
    store.put_bytes(f"{step_prefix(60)}/state.pt", b"in flight")  # newer: maybe still uploading

    deleted = cs.prune(keep=2)

    assert sorted(deleted) == [10, 15, 20, 30]
    assert cs.committed_steps() == [40, 50]
    assert store.exists(f"{step_prefix(60)}/state.pt")
    assert not store.exists(f"{step_prefix(15)}/state.pt")
    assert cs.latest().step == 50


def test_prune_does_not_count_a_truncated_newest_commit(store):
    cs = CheckpointStore(store)
    cs.save(10, b"ten-ten", {})
    cs.save(20, b"twenty-twenty", {})
    store.put_bytes(f"{step_prefix(20)}/state.pt", b"trunc")  # size no longer matches its record

    cs.prune(keep=1)

    # The last good checkpoint survives; the broken newer one is left for inspection.
    assert cs.latest().step == 10
    assert cs.committed_steps() == [10, 20]


class _GatedStore(LocalObjectStore):
    """A store whose state uploads block until released, to observe the background thread."""

    def __init__(self, root):
        super().__init__(root)
        self.gate = threading.Event()
        self.uploading = threading.Event()
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()

    def put_bytes(self, key, data, *, metadata=None):
        if key.endswith("state.pt"):
            with self._lock:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.uploading.set()
            self.gate.wait(10)
            with self._lock:
                self.in_flight -= 1
        super().put_bytes(key, data, metadata=metadata)


def test_async_checkpointer_uploads_in_background_one_at_a_time(tmp_path):
    store = _GatedStore(tmp_path / "ckpt")
    ckpt = AsyncCheckpointer(store, keep=2)

    started = time.monotonic()
    ckpt.submit(1, b"one", {})
    assert time.monotonic() - started < 1.0  # the caller was not held up by the upload
    assert store.uploading.wait(5)
    assert ckpt.written == 0

    # The next submit must wait for the upload in flight (bounded memory).
    second_done = threading.Event()
    t = threading.Thread(target=lambda: (ckpt.submit(2, b"two", {}), second_done.set()))
    t.start()
    assert not second_done.wait(0.3)
    store.gate.set()
    assert second_done.wait(5)
    t.join()
    ckpt.submit(3, b"three", {})
    ckpt.close()

    assert ckpt.written == 3
    assert store.max_in_flight == 1
    cs = CheckpointStore(store)
    assert cs.committed_steps() == [2, 3]  # pruned to keep=2
    assert cs.latest().payload == b"three"


class _FailingStore(LocalObjectStore):
    def put_bytes(self, key, data, *, metadata=None):
        if key.endswith("state.pt"):
            raise OSError("disk full")
        super().put_bytes(key, data, metadata=metadata)


def test_async_checkpointer_reraises_upload_errors(tmp_path):
    ckpt = AsyncCheckpointer(_FailingStore(tmp_path / "ckpt"), keep=1)
    ckpt.submit(1, b"one", {})
    with pytest.raises(OSError, match="disk full"):
        ckpt.flush()
    ckpt.submit(2, b"two", {})
    with pytest.raises(OSError, match="disk full"):
        ckpt.close()
    assert ckpt.written == 0
