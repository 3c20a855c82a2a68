"""Queue waits in the ledger: how long each gang waited for admission on each cluster it tried.

start_by placement estimates a cluster's wait from this history (hybridflow.waits); a task that runs
again replaces its rows, so a cleared try never counts twice.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine, select

from hybridflow.ledger.models import QueueWaitRow
from hybridflow.ledger.samples import _insert

OUTCOMES = ("admitted", "moved", "gave_up", "waiting")
_KEY = ["run_key", "attempt", "cluster"]


@dataclass(frozen=True)
class QueueWait:
    """One ended wait that led to admission; ``queued_at`` is timezone-aware UTC."""

    cluster: str
    gpus: int
    wait_s: float
    queued_at: datetime


def _naive_utc(ts: datetime, what: str) -> datetime:
    # The ledger stores naive UTC (like runs.py); a naive value is taken to be UTC already.
    if not isinstance(ts, datetime):
        raise ValueError(f"{what}: {ts!r} is not a datetime")
    return ts.astimezone(UTC).replace(tzinfo=None) if ts.tzinfo else ts


def record_queue_wait(run_key: str, attempt: str, cluster: str, gpus: int, priority: str,
                      queued_at: datetime, admitted_at: datetime | None, outcome: str,
                      engine: Engine | None = None, *, private_only: bool = False) -> None:
    """Store one gang's wait on ``cluster``, replacing an earlier row of the same (run_key, attempt, cluster).

    ``wait_s`` is derived: admitted_at - queued_at for an admitted gang, else None (a wait that moved
    elsewhere or gave up says nothing about how long admission there would have taken).
    """
    from hybridflow.ledger.engine import default_engine

    where = f"queue wait of {run_key!r} ({attempt}) on {cluster!r}"
    for name, value in (("run_key", run_key), ("attempt", attempt), ("cluster", cluster), ("priority", priority)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where}: {name} {value!r} must be a non-empty string")
    if outcome not in OUTCOMES:
        raise ValueError(f"{where}: outcome {outcome!r} is not one of {', '.join(OUTCOMES)}")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"{where}: gpus {gpus!r} is not a gang size (a whole number >= 1)")
    queued = _naive_utc(queued_at, f"{where}: queued_at")
    admitted = None if admitted_at is None else _naive_utc(admitted_at, f"{where}: admitted_at")
    # Only an admission ends a wait with a known length; anything else would put a wrong sample in the history.
    if (outcome == "admitted") != (admitted is not None):
        raise ValueError(f"{where}: admitted_at is given exactly when the outcome is 'admitted' "
                         f"(outcome {outcome!r}, admitted_at {admitted_at!r})")
    if admitted is not None and admitted < queued:
        raise ValueError(f"{where}: admitted_at {admitted_at} is before queued_at {queued_at}")

    row = {"run_key": run_key, "attempt": attempt, "cluster": cluster, "gpus": gpus, "priority": priority,
           "queued_at": queued, "admitted_at": admitted, "outcome": outcome, "private_only": bool(private_only),
           "wait_s": None if admitted is None else (admitted - queued).total_seconds()}
    engine = engine or default_engine()
    # An upsert on the unique key, as store_samples does: atomic, so two writers of one key cannot collide.
    stmt = _insert(engine)(QueueWaitRow.__table__).values(row)
    stmt = stmt.on_conflict_do_update(index_elements=_KEY,
                                      set_={c: stmt.excluded[c] for c in row if c not in _KEY})
    with engine.begin() as conn:
        conn.execute(stmt)


def queue_wait_history(*, days: int, clusters: Collection[str] | None = None, now: datetime | None = None,
                       engine: Engine | None = None) -> list[QueueWait]:
    """Admitted waits queued in the ``days`` days up to ``now`` (default: the current time), of
    ``clusters`` (None: every cluster), oldest first."""
    from hybridflow.ledger.engine import default_engine

    if isinstance(days, bool) or not isinstance(days, int) or days < 1:
        raise ValueError(f"days {days!r} must be a whole number >= 1")
    end = _naive_utc(now, "now") if now is not None else datetime.now(UTC).replace(tzinfo=None)
    t = QueueWaitRow.__table__.c
    query = (select(t.cluster, t.gpus, t.wait_s, t.queued_at)
             .where(t.outcome == "admitted", t.wait_s.is_not(None),
                    t.queued_at >= end - timedelta(days=days), t.queued_at <= end)
             .order_by(t.queued_at, t.cluster))
    if clusters is not None:
        query = query.where(t.cluster.in_(list(clusters)))
    engine = engine or default_engine()
    with engine.connect() as conn:
        return [QueueWait(cluster=r.cluster, gpus=r.gpus, wait_s=float(r.wait_s),
                          queued_at=r.queued_at.replace(tzinfo=UTC))
                for r in conn.execute(query)]


def last_private_only_admissions(*, hours: float, clusters: Collection[str] | None = None,
                                 now: datetime | None = None, engine: Engine | None = None) -> dict[str, datetime]:
    """Per cluster, when the newest gang that may run only on private clusters admitted there in the
    ``hours`` up to ``now`` first queued (timezone-aware UTC); clusters without one are left out."""
    from sqlalchemy import func

    from hybridflow.ledger.engine import existing_engine

    if isinstance(hours, bool) or not isinstance(hours, int | float) or hours <= 0:
        raise ValueError(f"hours {hours!r} must be a positive number")
    end = _naive_utc(now, "now") if now is not None else datetime.now(UTC).replace(tzinfo=None)
    t = QueueWaitRow.__table__.c
    query = (select(t.cluster, func.max(t.queued_at).label("last"))
             .where(t.outcome == "admitted", t.private_only.is_(True),
                    t.queued_at >= end - timedelta(hours=hours), t.queued_at <= end)
             .group_by(t.cluster))
    if clusters is not None:
        query = query.where(t.cluster.in_(list(clusters)))
    engine = engine or existing_engine()
    if engine is None:  # no ledger yet: nothing was ever admitted
        return {}
    with engine.connect() as conn:
        return {r.cluster: r.last.replace(tzinfo=UTC) for r in conn.execute(query)}
