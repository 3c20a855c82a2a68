"""Expected waits for admission, for start_by placement: from each cluster's load now and, when it has
no room, from the ledger's history of queue waits of gangs of about the same size. Pure: the caller
reads the loads and the history (hybridflow.ledger.queue_waits.queue_wait_history)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridflow.backends.base import ClusterLoad
    from hybridflow.ledger.queue_waits import QueueWait


@dataclass(frozen=True)
class WaitEstimate:
    cluster: str
    seconds: float | None  # None: unknown
    basis: str  # human-readable, goes into the placement explanation
    samples: int = 0


def format_duration(seconds: float) -> str:
    """``45 s``, ``14 min``, ``2 h``, ``3 h 20 min``: rounded to what a person compares at a glance."""
    if seconds < 59.5:
        return f"{round(seconds)} s"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


def quantile_of(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, interpolating linearly between the two nearest ranks
    (numpy's default method): the p80 of 10 waits lies between the 8th and 9th smallest."""
    if not values:
        raise ValueError("quantile of no values")
    if not 0 <= q <= 1:
        raise ValueError(f"quantile {q!r} is not between 0 and 1")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    below = math.floor(pos)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (pos - below)


def size_window(gpus: int) -> tuple[int, int]:
    """Gang sizes whose waits stand in for a gang of ``gpus``: half to twice its size."""
    return math.ceil(gpus / 2), gpus * 2


def estimate_waits(history: Sequence[QueueWait], loads: Mapping[str, ClusterLoad], gpus: int, *,
                   quantile: float, min_samples: int, days: int) -> dict[str, WaitEstimate]:
    """A wait estimate for a gang of ``gpus`` on each cluster in ``loads`` (keyed like it).

    ``history`` holds admitted waits of the last ``days`` days (``days`` only goes into the basis).
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus {gpus!r} is not a gang size (a whole number >= 1)")
    if not 0 < quantile <= 1:
        raise ValueError(f"quantile {quantile!r} must be in (0, 1], e.g. 0.8 for the p80")
    if min_samples < 1:
        raise ValueError(f"min_samples {min_samples!r} must be at least 1")
    lo, hi = size_window(gpus)
    # p80, p95, p99.9: the label without float noise (0.07 * 100 is 7.000000000000001).
    label = f"p{round(quantile * 100, 3):g}"
    out: dict[str, WaitEstimate] = {}
    for name, load in loads.items():
        if not load.reachable:
            why = f" ({load.reason})" if load.reason else ""
            out[name] = WaitEstimate(name, None, f"load of {name} unknown{why}: its wait cannot be estimated")
            continue
        if load.has_room(gpus):
            out[name] = WaitEstimate(name, 0.0, f"room now: {load.free} of {load.capacity} GPUs free, nobody queued")
            continue
        waits = [w.wait_s for w in history if w.cluster == name and lo <= w.gpus <= hi and w.wait_s is not None]
        sizes = f"{lo}-{hi} GPU gangs"  # lo < hi for any gang size
        if len(waits) < min_samples:
            out[name] = WaitEstimate(
                name, None, f"no history: only {len(waits)} waits of {sizes} on {name} in the last {days} days "
                f"(needs {min_samples})", samples=len(waits))
            continue
        seconds = quantile_of(waits, quantile)
        out[name] = WaitEstimate(
            name, seconds, f"{label} of {len(waits)} waits of {sizes} on {name} in the last {days} days: "
            f"{format_duration(seconds)}", samples=len(waits))
    return out


_ACCEPTED = "start_by must be a positive duration such as 2h, 90m, 1h30m or PT2H"
# 1d2h, 1h30m, 90s, 1.5h: each unit at most once, largest first; spaces between parts allowed.
_NUM = r"(\d+(?:\.\d+)?|\.\d+)"
_COMPOUND = re.compile(rf"(?:{_NUM}\s*d)?\s*(?:{_NUM}\s*h)?\s*(?:{_NUM}\s*m)?\s*(?:{_NUM}\s*s)?", re.IGNORECASE)
_UNIT_S = (86_400, 3_600, 60, 1)


def _iso_seconds(text: str) -> float | None:
    from pydantic import TypeAdapter, ValidationError

    date_part = text.upper().split("T", 1)[0]
    # Years and months have no fixed length (pydantic would take 365 and 30 days): not a deadline.
    if "Y" in date_part or "M" in date_part:
        return None
    try:
        return TypeAdapter(timedelta).validate_python(text.upper()).total_seconds()
    except ValidationError:
        return None


def parse_duration(text: str | float | int) -> float:
    """Seconds in a start_by value: ``90s``, ``45m``, ``2h``, ``1h30m``, ``1d``, ``1d2h``, a plain
    number of seconds (number or numeric string) or an ISO 8601 duration (``PT2H``, ``P1DT2H``).
    Anything else, zero or negative raises ValueError saying what is accepted."""
    seconds: float | None = None
    if isinstance(text, bool):  # True is an int to Python, not a duration to anyone
        seconds = None
    elif isinstance(text, int | float):
        seconds = float(text)
    elif isinstance(text, str):
        s = text.strip()
        try:
            seconds = float(s)
        except ValueError:
            if s[:1] in ("P", "p"):
                seconds = _iso_seconds(s)
            elif s and (m := _COMPOUND.fullmatch(s)) and any(m.groups()):
                seconds = sum(float(v) * unit for v, unit in zip(m.groups(), _UNIT_S, strict=True) if v)
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{_ACCEPTED}; got {text!r}")
    return seconds
