"""Private capacity kept for work that can only run there.

A run is *private-only* when no public cluster of the estate may take it: its data is restricted, or
it is limited to regions only private clusters are in. Such work has nowhere else to go, so while it
waits on a private cluster, or is expected there (the ledger saw some admitted there within
``placement.reservation.expect_within_h`` hours), a share of that cluster's GPUs
(``placement.reservation.share``) is kept for it: a run that may run public does not take them
(the ``reservation`` rule, explained per candidate like every other rule).

Making room: an interruptible run that may run public may still use the kept GPUs (``move_budget`` >
0); when private-only work then waits first in the queue behind it, its gang is checkpointed and
moved, and its task places it on a public cluster (:func:`movable`; the local backend's
``_make_room``). A run is moved at most ``move_budget`` times.

:func:`reservations` says which clusters keep GPUs and why, from their load readings and the ledger's
last private-only arrivals (:func:`last_private_only_arrivals`); :func:`verdict` is the rule.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from hybridflow.backends.base import ClusterLoad
from hybridflow.config import Cluster, Estate
from hybridflow.request import AdmittedRun

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reservation:
    cluster: str
    kept: int  # GPUs a run that may run public leaves free
    why: str  # what the GPUs are kept for
    # Interruptible runs may use them when > 0: they are moved off when needed.
    move_budget: int = 0


def private_only(run: AdmittedRun, estate: Estate) -> bool:
    """No public cluster may take the run: restricted data, or regions only private clusters are in."""
    if run.must_stay_private:
        return True
    allowed = set(run.regions or [])
    return not any(c.location == "public" and (not allowed or allowed & set(c.areas))
                   for c in estate.clusters.values())


def movable(run: AdmittedRun, cluster: Cluster, estate: Estate, moves: int) -> bool:
    """A gang of ``run`` on ``cluster`` may be moved to a public cluster to make room for private-only
    work: interruptible, may run public, on a private cluster, moved fewer than ``move_budget`` times."""
    return (run.interruptible and cluster.location == "private"
            and not private_only(run, estate) and moves < estate.pipeline.placement.reservation.move_budget)


def reservations(estate: Estate, loads: Mapping[str, ClusterLoad],
                 arrivals: Mapping[str, datetime], now: datetime | None = None) -> dict[str, Reservation]:
    """The private clusters that keep GPUs for private-only work now: some of it waits there
    (``ClusterLoad.private_only_queued``), or some was admitted there in the last
    ``expect_within_h`` hours (``arrivals``: cluster -> the newest such admission's queue time)."""
    cfg = estate.pipeline.placement.reservation
    if cfg.share <= 0:
        return {}
    now = now or datetime.now(UTC)
    out = {}
    for name, cluster in estate.clusters.items():
        if cluster.location != "private" or cluster.is_dr:
            continue
        kept = math.ceil(cfg.share * cluster.total_gpus)
        load = loads.get(name)
        waiting = load.private_only_queued if load is not None else 0
        last = arrivals.get(name)
        if waiting:
            why = f"{waiting} GPUs of work that may run only on private clusters wait here"
        elif last is not None and (now - last).total_seconds() <= cfg.expect_within_h * 3600:
            ago = max((now - last).total_seconds(), 0) / 3600
            why = (f"work that may run only on private clusters is expected (some was admitted here {ago:.1f} h ago, "
                   f"within placement.reservation.expect_within_h = {cfg.expect_within_h:g})")
        else:
            continue
        out[name] = Reservation(name, kept, why, cfg.move_budget)
    return out


def verdict(run: AdmittedRun, cluster: Cluster, reservation: Reservation | None, used: int, queued: int,
            public: Sequence[str]) -> str | None:
    """Why a run that public clusters (``public``: those that would take it) could take does not take
    a private cluster's kept GPUs (None: it may)."""
    if reservation is None or not public or cluster.location != "private":
        return None
    if run.interruptible and reservation.move_budget > 0:
        return None  # it may use them: it is moved off when such work waits behind it (making room)
    room = cluster.total_gpus - reservation.kept
    if used + queued + run.workers <= room:
        return None
    return (f"{reservation.kept} of {cluster.total_gpus} GPUs are kept for work that may run only on private "
            f"clusters ({reservation.why}); this run may run on {', '.join(public)}, and {used} in use + {queued} "
            f"queued + its {run.workers} would pass the {room} others may use here (placement.reservation.share)")


def last_private_only_arrivals(estate: Estate) -> dict[str, datetime]:
    """Each private cluster's newest admission of private-only work in the ledger within
    ``expect_within_h`` (none when the ledger cannot be read: only the live queues count then)."""
    cfg = estate.pipeline.placement.reservation
    private = [n for n, c in estate.clusters.items() if c.location == "private" and not c.is_dr]
    if cfg.share <= 0 or not private or cfg.expect_within_h <= 0:
        return {}
    from hybridflow.ledger.queue_waits import last_private_only_admissions

    try:
        return last_private_only_admissions(hours=cfg.expect_within_h, clusters=private)
    except Exception as exc:  # noqa: BLE001 - no ledger: the queues alone say what waits
        log.warning("private-only arrivals unavailable (%s); reserving for queued work only", exc)
        return {}
