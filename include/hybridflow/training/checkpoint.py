"""Training checkpoints in an object store, committed so a reader never loads a partial one.

Layout, relative to the run's checkpoint store::

    step-000000100/state.pt         the serialised training state (written first)
    step-000000100/COMMITTED.json   {"step", "size", "sha256", "time", "meta"} (written last)

A checkpoint exists only once its ``COMMITTED.json`` does, and it is loaded only if ``state.pt``
still matches the size and SHA-256 recorded there. A worker killed mid-upload therefore leaves a
partial folder that is skipped (and later pruned), never a truncated state that a resumed run loads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from hybridflow.storage.objectstore import ObjectStore

log = logging.getLogger(__name__)

STATE_NAME = "state.pt"
COMMIT_NAME = "COMMITTED.json"
_KEY_RE = re.compile(r"^step-(\d{9})/(state\.pt|COMMITTED\.json)$")


def step_prefix(step: int) -> str:
    return f"step-{step:09d}"


@dataclass(frozen=True)
class Checkpoint:
    step: int
    payload: bytes = field(repr=False)
    sha256: str
    size: int
    time: float
    meta: dict


class CheckpointStore:
    """Save, find, verify and prune checkpoints of one run in ``store``."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    # -- writing -----------------------------------------------------------------------------
    def save(self, step: int, payload: bytes, meta: dict | None = None) -> Checkpoint:
        prefix = step_prefix(step)
        commit_key = f"{prefix}/{COMMIT_NAME}"
        # Re-saving a step (e.g. a rerun reaching the same step) first withdraws the old commit, so
        # a reader in between falls back to an older checkpoint instead of a mismatching pair.
        if self.store.exists(commit_key):
            self.store.delete(commit_key)
        self.store.put_bytes(f"{prefix}/{STATE_NAME}", payload)
        record = {
            "step": step,
            "size": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
            "time": time.time(),
            "meta": meta or {},
        }
        self.store.put_bytes(commit_key, json.dumps(record, sort_keys=True).encode())
        return Checkpoint(
            step=step,
            payload=payload,
            sha256=record["sha256"],
            size=record["size"],
            time=record["time"],
            meta=record["meta"],
        )

    # -- reading -----------------------------------------------------------------------------
    def _scan(self) -> dict[int, dict[str, int]]:
        """step -> {file name: listed size} for every step folder present."""
        found: dict[int, dict[str, int]] = {}
        for info in self.store.list("step-"):
            m = _KEY_RE.match(info.key)
            if m:
                found.setdefault(int(m.group(1)), {})[m.group(2)] = info.size
        return found

    def committed_steps(self) -> list[int]:
        """Steps that have a commit record, oldest first (not yet verified)."""
        return sorted(s for s, files in self._scan().items() if COMMIT_NAME in files)

    def load(self, step: int) -> Checkpoint:
        """The committed checkpoint at ``step``; raises ValueError if it is missing or corrupt."""
        prefix = step_prefix(step)
        try:
            record = json.loads(self.store.get_bytes(f"{prefix}/{COMMIT_NAME}"))
        except FileNotFoundError as exc:
            raise ValueError(f"checkpoint step {step} is not committed") from exc
        except ValueError as exc:
            raise ValueError(f"checkpoint step {step} has an unreadable commit record: {exc}") from exc
        try:
            payload = self.store.get_bytes(f"{prefix}/{STATE_NAME}")
        except FileNotFoundError as exc:
            raise ValueError(f"checkpoint step {step} is committed but its {STATE_NAME} is missing") from exc
        digest = hashlib.sha256(payload).hexdigest()
        if len(payload) != record.get("size") or digest != record.get("sha256"):
            raise ValueError(
                f"checkpoint step {step} is corrupt: {STATE_NAME} has size {len(payload)} sha256 "
                f"{digest[:12]}, commit record says size {record.get('size')} sha256 "
                f"{str(record.get('sha256'))[:12]}"
            )
        return Checkpoint(
            step=step,
            payload=payload,
            sha256=digest,
            size=len(payload),
            time=float(record.get("time", 0.0)),
            meta=record.get("meta") or {},
        )

    def latest(self) -> Checkpoint | None:
        """The newest committed checkpoint that verifies; partial and corrupt ones are skipped."""
        scan = self._scan()
        for step in sorted(scan, reverse=True):
            if COMMIT_NAME not in scan[step]:
                log.info("skipping checkpoint step %d: not committed (partial upload)", step)
                continue
            try:
                return self.load(step)
            except ValueError as exc:
                log.warning("skipping %s", exc)
        return None

    def _listed_size_ok(self, step: int, listed_size: int) -> bool:
        try:
            record = json.loads(self.store.get_bytes(f"{step_prefix(step)}/{COMMIT_NAME}"))
        except (FileNotFoundError, ValueError):
            return False
        return record.get("size") == listed_size

    # -- retention ---------------------------------------------------------------------------
    def prune(self, keep: int) -> list[int]:
        """Delete all but the ``keep`` newest committed checkpoints, plus partial folders older
        than the newest commit (those uploads were abandoned). Returns the steps deleted."""
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        scan = self._scan()
        # A commit whose listed state size is wrong does not count towards ``keep``, so a corrupt
        # newest checkpoint never causes the last good one to be deleted (sizes come with the listing).
        kept: set[int] = set()
        for step in sorted(scan, reverse=True):
            if len(kept) >= keep:
                break
            files = scan[step]
            if COMMIT_NAME in files and STATE_NAME in files and self._listed_size_ok(step, files[STATE_NAME]):
                kept.add(step)
        newest_commit = max((s for s, f in scan.items() if COMMIT_NAME in f), default=None)
        deleted = []
        for step, files in sorted(scan.items()):
            if step in kept:
                continue
            committed = COMMIT_NAME in files
            if not committed and (newest_commit is None or step > newest_commit):
                continue  # possibly an upload still in flight
            if committed and step > min(kept, default=step):
                continue  # a newer commit that failed the cheap check; leave it for inspection
            prefix = step_prefix(step)
            # Commit record first: a half-deleted folder then reads as partial, never as committed.
            if committed:
                self.store.delete(f"{prefix}/{COMMIT_NAME}")
            if STATE_NAME in files:
                self.store.delete(f"{prefix}/{STATE_NAME}")
            deleted.append(step)
        return deleted


class AsyncCheckpointer:
    """Uploads checkpoints on one background thread so training keeps running.

    The caller serialises the state (a consistent snapshot) and hands over bytes. At most one
    upload is in flight: ``submit`` waits for the previous one, which bounds memory to one extra
    copy of the state. An upload error is re-raised by the next ``submit``, ``flush`` or ``close``:
    a run that cannot checkpoint should fail loudly, not train on without a recovery point.
    """

    def __init__(self, store: ObjectStore | CheckpointStore, keep: int) -> None:
        self.checkpoints = store if isinstance(store, CheckpointStore) else CheckpointStore(store)
        self.keep = keep
        self.written = 0
        self.last_step: int | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-upload")
        self._pending: Future | None = None
        self._lock = threading.Lock()

    def _upload(self, step: int, payload: bytes, meta: dict) -> None:
        started = time.monotonic()
        self.checkpoints.save(step, payload, meta)
        self.checkpoints.prune(self.keep)
        with self._lock:
            self.written += 1
            self.last_step = step
        log.info(
            "checkpoint step %d committed (%d bytes, %.2fs)", step, len(payload), time.monotonic() - started
        )

    def submit(self, step: int, payload: bytes, meta: dict | None = None) -> None:
        self.flush()
        self._pending = self._pool.submit(self._upload, step, payload, dict(meta or {}))

    def flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
