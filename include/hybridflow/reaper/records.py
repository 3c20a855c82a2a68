"""The reaper's sweeps in the ledger: each sweep with what it released (or, in dry-run, would have),
and the newest sweep as the UI page shows it.

A sweep is recorded under a key (e.g. its DAG run's data interval): recording the same key again
replaces the sweep and all its rows in one transaction, so a re-run never counts a release twice.
Times are stored as naive UTC, like the ledger's other tables.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, delete, insert, select

from hybridflow.ledger.models import ReaperReleaseRow, ReaperSweepRow
from hybridflow.reaper.base import Release, Sweep

_SWEEPS = ReaperSweepRow.__table__
_RELEASES = ReaperReleaseRow.__table__


def _naive(ts: datetime | None) -> datetime | None:
    if ts is None:
        return None
    return ts.astimezone(UTC).replace(tzinfo=None) if ts.tzinfo else ts


def _aware(ts: datetime | None) -> datetime | None:
    return None if ts is None else ts.replace(tzinfo=UTC)


def _release_row(key: str, r: Release) -> dict[str, Any]:
    lo, owner = r.leftover, r.leftover.owner
    return {
        "sweep_key": key, "place": lo.place, "kind": lo.kind, "name": lo.name,
        "owner_dag_id": owner.dag_id if owner else None, "owner_run_id": owner.run_id if owner else None,
        "owner_task_id": owner.task_id if owner else None, "owner_try": owner.try_number if owner else None,
        "gpus": int(lo.gpus), "gpu_hours": float(r.gpu_hours), "since": _naive(lo.since),
        "reason": lo.reason or None, "dry_run": bool(r.dry_run), "released": bool(r.released),
        "error": r.error or None,
    }


def record_sweep(sweep: Sweep, *, key: str, engine: Engine | None = None) -> None:
    """Store ``sweep`` and each of its releases under ``key``, replacing what an earlier recording of
    the same key stored (idempotent per key)."""
    from hybridflow.ledger.engine import default_engine

    if not isinstance(key, str) or not key:
        raise ValueError(f"sweep key {key!r} must be a non-empty string")
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for release in sweep.releases:
        row = _release_row(key, release)
        rows[(row["place"], row["kind"], row["name"])] = row  # one row per thing, the last word wins
    head = {
        "sweep_key": key, "started_at": _naive(sweep.started), "finished_at": _naive(sweep.finished),
        "kept": int(sweep.kept), "errors": json.dumps(sweep.errors, sort_keys=True) if sweep.errors else None,
        "recorded_at": datetime.now(UTC).replace(tzinfo=None),
    }
    engine = engine or default_engine()
    with engine.begin() as conn:
        conn.execute(delete(_RELEASES).where(_RELEASES.c.sweep_key == key))
        conn.execute(delete(_SWEEPS).where(_SWEEPS.c.sweep_key == key))
        conn.execute(insert(_SWEEPS).values(head))
        if rows:
            conn.execute(insert(_RELEASES), list(rows.values()))


def _row_view(r: Any) -> dict[str, Any]:
    owner = None
    if r.owner_dag_id is not None:
        owner = {"dag_id": r.owner_dag_id, "run_id": r.owner_run_id, "task_id": r.owner_task_id,
                 "try_number": r.owner_try}
    return {
        "place": r.place, "kind": r.kind, "name": r.name, "owner": owner, "gpus": r.gpus,
        "gpu_hours": float(r.gpu_hours or 0.0), "since": _aware(r.since), "reason": r.reason or "",
        "dry_run": bool(r.dry_run), "released": bool(r.released), "error": r.error or "",
    }


def _summary(rows: list[dict[str, Any]], errors: dict[str, str]) -> dict[str, Any]:
    places: dict[str, dict[str, Any]] = {}
    for row in rows:
        p = places.setdefault(row["place"], {"dry_run": True, "released": 0, "listed": 0, "failed": 0})
        p["dry_run"] = p["dry_run"] and row["dry_run"]
        p["released" if row["released"] else ("failed" if row["error"] else "listed")] += 1
    return {
        "released": sum(1 for r in rows if r["released"]),
        "listed": sum(1 for r in rows if r["dry_run"] and not r["released"] and not r["error"]),
        "failed": sum(1 for r in rows if r["error"]),
        # Stopped: what a release really ended. Would stop: what dry-run places only listed.
        "gpu_hours_stopped": sum(r["gpu_hours"] for r in rows if r["released"]),
        "gpu_hours_would_stop": sum(r["gpu_hours"] for r in rows if r["dry_run"] and not r["released"]
                                    and not r["error"]),
        "places": dict(sorted(places.items())),
        "errors": errors,
    }


def last_sweep(engine: Engine | None = None) -> dict[str, Any] | None:
    """The newest sweep (by start): its key, when it ran, counts, GPU-hours stopped (and, in dry-run
    places, that would have been), places that could not be swept, and each row; None before the first."""
    from hybridflow.ledger.engine import default_engine

    engine = engine or default_engine()
    with engine.connect() as conn:
        head = conn.execute(select(_SWEEPS).order_by(_SWEEPS.c.started_at.desc(), _SWEEPS.c.recorded_at.desc())
                            .limit(1)).first()
        if head is None:
            return None
        found = conn.execute(select(_RELEASES).where(_RELEASES.c.sweep_key == head.sweep_key)
                             .order_by(_RELEASES.c.place, _RELEASES.c.kind, _RELEASES.c.name)).all()
    rows = [_row_view(r) for r in found]
    errors = json.loads(head.errors) if head.errors else {}
    return {
        "key": head.sweep_key, "started": _aware(head.started_at), "finished": _aware(head.finished_at),
        "kept": head.kept, **_summary(rows, errors), "rows": rows,
    }
