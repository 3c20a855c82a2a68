"""One sweep: ask every finder for its candidates, judge each by its owner's Airflow states (or the
finder's own reason), and release the leftovers, or only list them where the place is in dry-run.

A thing the finder marks as not this Airflow instance's (``Leftover.skip``) is only reported
(``Sweep.skipped``). A place whose finder fails is an error of the sweep (``Sweep.errors``), never a crash of the
others; a release that fails is recorded with its error. Releasing is idempotent, so a cleared and
re-run sweep does no harm.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Protocol

from hybridflow.reaper.base import Finder, Leftover, Release, Sweep
from hybridflow.reaper.liveness import ENDED
from hybridflow.reaper.states import Judgement

log = logging.getLogger(__name__)


class Judge(Protocol):
    def judge(self, owner) -> Judgement: ...


def gpu_hours(leftover: Leftover, ended: datetime | None, now: datetime) -> float:
    """GPU-hours ``leftover`` held since its owner ended (else since it was made): what releasing it
    stops from growing. 0 for things that hold no GPUs or whose start is unknown."""
    start = ended or leftover.since
    if not leftover.gpus or start is None:
        return 0.0
    return round(leftover.gpus * max((now - start).total_seconds(), 0.0) / 3600, 4)


def judge_leftover(leftover: Leftover, states: Judge) -> Judgement:
    """ENDED (release it), or ALIVE / UNKNOWN (keep it). Without an owner, the finder's ``reason``
    is the verdict; a thing with neither is kept."""
    if leftover.owner is not None:
        return states.judge(leftover.owner)
    if leftover.reason:
        return Judgement(ENDED, None, leftover.reason)
    return Judgement("unknown", None, "no owner recorded on it")


def sweep(finders: Iterable[Finder], states: Judge, *, dry_run: Callable[[str], bool], now: datetime,
          clock: Callable[[], datetime], key: str = "") -> Sweep:
    """Sweep every place of ``finders``; ``dry_run(place)``: only list what is found there."""
    out = Sweep(started=now, key=key)
    for finder in finders:
        try:
            found = finder.find(now)
        except Exception as exc:  # noqa: BLE001 - one place that cannot be swept does not stop the others
            why = f"{type(finder).__name__}: {type(exc).__name__}: {exc}"
            log.error("could not sweep %s: %s", finder.place, why)
            out.errors[finder.place] = "; ".join(filter(None, (out.errors.get(finder.place), why)))
            continue
        for leftover in found:
            if leftover.skip:
                log.info("leaving %s %s in %s alone: it %s", leftover.kind, leftover.name, leftover.place, leftover.skip)
                out.skipped.append(leftover)
                continue
            release = _settle(finder, leftover, states, dry_run(leftover.place), now)
            if release is None:
                out.kept += 1
            else:
                out.releases.append(release)
    out.finished = clock()
    log.info("sweep %s: %d released, %d listed (dry-run), %d kept, %d left alone (another Airflow instance's, or "
             "naming none), %d places with errors", key or "(no key)", sum(r.released for r in out.releases),
             sum(r.dry_run for r in out.releases), out.kept, len(out.skipped), len(out.errors))
    return out


def _settle(finder: Finder, leftover: Leftover, states: Judge, dry_run: bool, now: datetime) -> Release | None:
    """Judge one candidate: None (kept), or what was done with it."""
    what = f"{leftover.kind} {leftover.name} in {leftover.place}"
    judged = judge_leftover(leftover, states)
    if judged.verdict != ENDED:
        log.info("keeping %s: %s (%s)", what, judged.verdict, judged.why)
        return None
    hours = gpu_hours(leftover, judged.ended, now)
    if dry_run:
        log.info("dry-run: would release %s (%s; %d GPUs, %.2f GPU-hours)", what, judged.why, leftover.gpus, hours)
        return Release(leftover, dry_run=True, released=False, gpu_hours=hours)
    try:
        finder.release(leftover)
    except Exception as exc:  # noqa: BLE001 - recorded; the next sweep tries again
        log.error("could not release %s: %s: %s", what, type(exc).__name__, exc)
        return Release(leftover, dry_run=False, released=False, gpu_hours=hours, error=f"{type(exc).__name__}: {exc}")
    log.info("released %s (%s; %d GPUs, %.2f GPU-hours)", what, judged.why, leftover.gpus, hours)
    return Release(leftover, dry_run=False, released=True, gpu_hours=hours)
