"""Progress lines and the byte budget that bounds the memory of an upload call."""

from __future__ import annotations

import threading
import time
from typing import Any


class TransferProgress:
    """Thread-safe counters that log bytes, objects, rate and ETA at most every ``every_s``."""

    def __init__(self, total_bytes: int, total_objects: int, *, every_s: float, log: Any, what: str) -> None:
        self.total_bytes, self.total_objects = total_bytes, total_objects
        self.bytes = 0
        self.objects = 0
        self.every_s = every_s
        self.log = log
        self.what = what
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._last = self._started

    def add(self, nbytes: int = 0, objects: int = 0) -> None:
        with self._lock:
            self.bytes += nbytes
            self.objects += objects
            now = time.monotonic()
            if now - self._last < self.every_s:
                return
            self._last = now
            line = self.line(now)
        self.log.info(line)

    def line(self, now: float | None = None) -> str:
        elapsed = max((now or time.monotonic()) - self._started, 1e-9)
        rate = self.bytes / elapsed
        left = max(self.total_bytes - self.bytes, 0)
        eta = f"{left / rate:.0f}s" if rate > 0 else "?"
        pct = 100.0 * self.bytes / self.total_bytes if self.total_bytes else 100.0
        return (
            f"{self.what}: {_human(self.bytes)} of {_human(self.total_bytes)} ({pct:.0f}%), "
            f"{self.objects}/{self.total_objects} objects, {_human(rate)}/s, ETA {eta}"
        )


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GiB"


class ByteBudget:
    """Blocks readers while ``limit`` bytes are read but not yet acknowledged by the store."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self._cond = threading.Condition()

    def take(self, n: int) -> None:
        with self._cond:
            # One item larger than the limit still proceeds alone.
            while self.used and self.used + n > self.limit:
                self._cond.wait()
            self.used += n

    def give(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()
