"""Byte-rate caps on uploads into object stores, shared by every process of this machine.

A cap is a key (an endpoint, or a cluster whose cache bucket it is) and a rate. An upload under a
cap reserves its bytes in steps of :data:`STEP` before it sends them: a reservation moves the cap's
theoretical arrival time (TAT, as in GCRA) on by ``bytes / rate`` and the sender waits until the
TAT it started from. The TAT lives in a 16-byte file per cap under the state dir, locked with
``flock``, so the Airflow task's staging, DR replication and the local gang's checkpoint commits
(other processes) draw on one budget.

Checkpoint uploads come first (``priority="checkpoint"``): each of their reservations holds bulk
uploads off for the rest of its slot plus :data:`HOLD_S`, and bulk never reserves more than one
step ahead of now, so a checkpoint starting in the middle of a large stage waits for at most about
one step of bulk bytes. A bulk upload held off for :data:`STARVE_S` still sends one step, so its open
requests are not cut by the store's idle timeout while a long checkpoint goes up.

Bytes are metered where they leave: :class:`MeteredBody` wraps a request body and reserves as the
HTTP layer reads it, so a 16 MiB part goes out at the cap's pace, not as one burst. Without a cap
no body is wrapped and nothing here runs.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

STEP = 1024 * 1024  # bytes reserved at a time
HOLD_S = 0.1  # a checkpoint's reservation keeps bulk uploads off this long after its slot ends
STARVE_S = 10.0  # a bulk upload held off this long sends one step anyway
_POLL_S = 0.05  # longest sleep of a held-off bulk upload between two looks
_STATE = struct.Struct("<dd")  # TAT, bulk held off until (epoch seconds)
PRIORITIES = ("bulk", "checkpoint")


@dataclass(frozen=True)
class Cap:
    """Uploads counted under ``key`` go at most ``bytes_per_s``."""

    key: str
    bytes_per_s: float

    def __post_init__(self) -> None:
        if not self.key or self.bytes_per_s <= 0:
            raise ValueError(f"a bandwidth cap needs a key and a rate above 0, got {self.key!r}: {self.bytes_per_s}")


def endpoint_key(endpoint_url: str | None, region: str) -> str:
    """The cap key of an S3 endpoint: its URL (lower-cased, no trailing slash), or ``aws:<region>``."""
    if not endpoint_url:
        return f"endpoint:aws:{region}"
    return "endpoint:" + endpoint_url.strip().rstrip("/").lower()


def bucket_dir() -> Path:
    """Where the caps' shared state lives: the state dir of this machine's HYBRIDFLOW_HOME."""
    from hybridflow.settings import get_settings

    return get_settings().state_dir / "bandwidth"


class SharedBucket:
    """One cap's TAT, shared through a file: threads of this process take ``_lock``, processes
    ``flock``."""

    def __init__(self, path: Path, rate: float) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.rate = path, rate
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._lock = threading.Lock()

    def try_reserve(self, n: int, *, checkpoint: bool, starved: bool) -> tuple[bool, float]:
        """Reserve ``n`` bytes: ``(True, seconds to wait before sending)``, or ``(False, seconds
        to look again after)`` for a bulk upload held off."""
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                now = time.time()
                raw = os.pread(self._fd, _STATE.size, 0)
                tat, held_until = _STATE.unpack(raw) if len(raw) == _STATE.size else (0.0, 0.0)
                if tat > now + 3600:  # a clock stepped back (or a stale file): start again
                    tat = held_until = 0.0
                start = max(tat, now)
                if not checkpoint:
                    if held_until > now and not starved:
                        return False, min(_POLL_S, held_until - now)
                    if start - now > STEP / self.rate:  # bulk reserves at most one step ahead
                        return False, min(_POLL_S, start - now - STEP / self.rate)
                tat = start + n / self.rate
                if checkpoint:
                    held_until = max(held_until, tat + HOLD_S)
                os.pwrite(self._fd, _STATE.pack(tat, held_until), 0)
                return True, start - now
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)


_buckets: dict[tuple[str, float, int], SharedBucket] = {}
_buckets_lock = threading.Lock()


def _forget_in_child() -> None:
    # The local backend forks its gang workers from a warm process: a child starts with its own
    # handles, and with a lock no thread of its parent may still hold.
    global _buckets_lock
    _buckets_lock = threading.Lock()
    for bucket in _buckets.values():
        os.close(bucket._fd)
    _buckets.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def shared_bucket(cap: Cap, directory: Path | None = None) -> SharedBucket:
    """This process's handle on ``cap``'s shared state (one per cap, directory and process: a forked
    child sharing its parent's open file, flock would not keep the two apart)."""
    directory = directory or bucket_dir()
    name = hashlib.sha256(cap.key.encode()).hexdigest()[:24]
    key = (str(directory / f"{name}.tat"), cap.bytes_per_s, os.getpid())
    with _buckets_lock:
        bucket = _buckets.get(key)
        if bucket is None:
            bucket = _buckets[key] = SharedBucket(directory / f"{name}.tat", cap.bytes_per_s)
        return bucket


class Throttle:
    """Every cap an upload is under, and whether it is a checkpoint's (first) or bulk."""

    def __init__(self, caps: Iterable[Cap], *, priority: str = "bulk", directory: Path | None = None) -> None:
        if priority not in PRIORITIES:
            raise ValueError(f"priority {priority!r}; use one of {', '.join(PRIORITIES)}")
        self.caps = tuple(caps)
        if not self.caps:
            raise ValueError("a Throttle needs at least one cap")
        self.checkpoint = priority == "checkpoint"
        self._directory = directory or bucket_dir()  # resolved once: where this process was told to look
        for cap in self.caps:
            shared_bucket(cap, self._directory)  # a state dir that cannot be written fails here, not mid-upload

    def take(self, n: int) -> None:
        """Wait until ``n`` bytes may be sent under every cap."""
        for bucket in (shared_bucket(c, self._directory) for c in self.caps):
            waiting_since = time.monotonic()
            while True:
                starved = time.monotonic() - waiting_since > STARVE_S
                ok, wait = bucket.try_reserve(n, checkpoint=self.checkpoint, starved=starved)
                if wait > 0:
                    time.sleep(wait)
                if ok:
                    break

    def body(self, data, length: int) -> MeteredBody:
        """``data`` (bytes, or a seekable file of ``length`` bytes) as a request body that takes
        its bytes from this throttle as the HTTP layer reads them."""
        if isinstance(data, bytes | bytearray | memoryview):
            from hybridflow.storage.transfer_bodies import ViewReader

            data = ViewReader(memoryview(data))
        return MeteredBody(data, length, self)


def body_length(data) -> int:
    """Bytes a request body will send from where it stands."""
    if isinstance(data, memoryview):
        return data.nbytes
    if isinstance(data, bytes | bytearray):
        return len(data)
    try:
        return len(data)
    except TypeError:
        here = data.tell()
        end = data.seek(0, io.SEEK_END)
        data.seek(here)
        return end - here


class MeteredBody(io.RawIOBase):
    """A seekable request body that reserves each step of its bytes before handing it out. A
    retry rewinds it (botocore seeks to 0) and its bytes are reserved again: they are sent again."""

    def __init__(self, raw, length: int, throttle: Throttle) -> None:
        super().__init__()
        self._raw, self._length, self._throttle = raw, length, throttle
        self._pos = self._reserved = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def _reserve_for(self, n: int) -> int:
        n = min(n, self._length - self._pos)
        if n > 0 and self._pos + n > self._reserved:
            step = min(STEP, self._length - self._reserved)
            self._throttle.take(step)
            self._reserved += step
        return max(0, min(n, self._reserved - self._pos))

    def read(self, n: int = -1) -> bytes:
        n = self._length - self._pos if n is None or n < 0 else n
        n = self._reserve_for(n)
        out = self._raw.read(n) if n else b""
        self._pos += len(out)
        return out

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = self._raw.seek(offset, whence)
        self._reserved = min(self._reserved, self._pos)  # bytes sent again are reserved again
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return self._length
