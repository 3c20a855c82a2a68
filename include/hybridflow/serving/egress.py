"""Bytes the model gateway sends out: the response bodies it forwards, per endpoint, model version and
UTC day, kept in ``<state_root>/<endpoint>/egress/<day>.json`` (``{version: bytes}``).

The gateway counts in memory and adds what it counted to the day's file about once a second (and when
it stops), so a gateway that crashes loses at most that second, and one started again adds to the
totals already written. The nightly quota count reads a finished day's files into the ledger's
``transfer`` table (kind ``serving``). Serving pods on Kubernetes answer through their own Service,
not through this gateway: their bytes are not counted here.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from collections import defaultdict
from datetime import UTC, date, datetime
from pathlib import Path

EGRESS_DIR = "egress"
FLUSH_S = 1.0  # how often the gateway adds what it counted to the day's files


def egress_file(state_root: Path, endpoint: str, day: date) -> Path:
    return state_root / endpoint / EGRESS_DIR / f"{day.isoformat()}.json"


class EgressCounter:
    """The gateway's count of bytes sent per (day, endpoint, version) since its last flush."""

    def __init__(self, state_root: Path) -> None:
        self.state_root = state_root
        self._pending: dict[tuple[date, str, str], int] = defaultdict(int)
        self._lock = threading.Lock()

    def add(self, endpoint: str, version: str, n_bytes: int, *, when: datetime | None = None) -> None:
        day = (when or datetime.now(UTC)).astimezone(UTC).date()
        with self._lock:
            self._pending[(day, endpoint, version)] += n_bytes

    def flush(self) -> None:
        """Add what was counted since the last flush to the day files (under a lock: two writers add,
        never overwrite each other)."""
        with self._lock:
            pending, self._pending = self._pending, defaultdict(int)
        by_file: dict[tuple[date, str], dict[str, int]] = defaultdict(dict)
        for (day, endpoint, version), n in pending.items():
            by_file[(day, endpoint)][version] = n
        failed: OSError | None = None
        for (day, endpoint), counts in by_file.items():
            try:
                _add_to(egress_file(self.state_root, endpoint, day), counts)
            except OSError as exc:
                failed = failed or exc
                with self._lock:  # kept for the next flush, not lost
                    for version, n in counts.items():
                        self._pending[(day, endpoint, version)] += n
        if failed is not None:
            raise failed


def _add_to(path: Path, counts: dict[str, int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        totals = _read(path)
        for version, n in counts.items():
            totals[version] = totals.get(version, 0) + n
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(totals, sort_keys=True))
        os.replace(tmp, path)  # a reader sees the old totals or the new ones, never half a file


def _read(path: Path) -> dict[str, int]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        raise ValueError(f"{path}: not the gateway's egress counts ({exc}); move it aside and let the gateway "
                         "write the day again") from None
    return {str(k): int(v) for k, v in data.items()}


def served_bytes(state_root: Path, day: date) -> dict[tuple[str, str], int]:
    """(endpoint, version) -> bytes the gateway sent on ``day`` (UTC)."""
    out: dict[tuple[str, str], int] = {}
    for path in sorted(Path(state_root).glob(f"*/{EGRESS_DIR}/{day.isoformat()}.json")):
        for version, n in _read(path).items():
            out[(path.parent.parent.name, version)] = n
    return out
