"""Run records into the ledger: the run and every training attempt, replaced as a whole on re-ingest."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, delete
from sqlalchemy.orm import Session

from hybridflow.errors import HybridFlowError
from hybridflow.ledger.models import Attempt, Run


class RunRecordError(HybridFlowError):
    """A run record the ledger cannot take."""


def _when(value: Any, what: str) -> datetime | None:
    if value in (None, ""):
        return None
    try:
        ts = datetime.fromisoformat(str(value))
    except ValueError:
        raise RunRecordError(f"{what}: {value!r} is not an ISO 8601 timestamp; the train task writes "
                             "e.g. 2026-11-02T10:00:00+00:00") from None
    return (ts if ts.tzinfo else ts.replace(tzinfo=UTC)).astimezone(UTC).replace(tzinfo=None)


def attempt_rows(record: Mapping[str, Any]) -> list[dict]:
    """The record's training attempts as ledger rows.

    An attempt without a duration (its launcher died) is taken to have run until the next attempt
    started, else until the record was written: an upper bound, as the train task counts it.
    """
    run_key = record["run_key"]
    attempts = record.get("train_attempts") or []
    recorded_at = _when(record.get("recorded_at"), f"run record {run_key}: recorded_at")
    rows = []
    for i, a in enumerate(attempts):
        where = f"run record {run_key}: train_attempts[{i}]"
        started = _when(a.get("started_at"), f"{where}.started_at")
        if started is None:
            raise RunRecordError(f"{where}.started_at is missing; every attempt is noted with its start")
        following = attempts[i + 1] if i + 1 < len(attempts) else None
        if a.get("seconds") is not None:
            ended = started + timedelta(seconds=float(a["seconds"]))
        elif following is not None:
            ended = _when(following.get("started_at"), f"{where}+1.started_at")
        else:
            ended = recorded_at
        gpus = a.get("workers", record.get("workers"))
        if not isinstance(gpus, int) or gpus < 0:
            raise RunRecordError(f"{where}.workers: {gpus!r} is not a GPU count (a whole number >= 0)")
        last, nxt = a.get("last_step"), (following or {}).get("start_step")
        rows.append({
            "run_key": run_key, "seq": i, "try_number": a.get("try_number"), "label": a.get("attempt"),
            "cluster": a.get("cluster") or record.get("cluster"), "started_at": started, "ended_at": ended,
            "gpus": gpus, "outcome": a.get("outcome") or "unknown", "start_step": a.get("start_step"),
            "last_step": last, "steps_lost": max(0, last - nxt) if last is not None and nxt is not None else None,
        })
    return rows


def run_row(record: Mapping[str, Any]) -> dict:
    for key in ("run_key", "project"):
        if not record.get(key):
            raise RunRecordError(f"run record: {key!r} is missing; records are written by the pipeline's record step")
    training = record.get("training") or {}
    return {
        "run_key": record["run_key"], "project": record["project"], "team": record.get("team"),
        "cluster": record.get("cluster"), "gpu_model": record.get("gpu_type"),
        "pricing_class": record.get("pricing_class"), "price_per_gpu_hour": record.get("price_per_gpu_hour"),
        "workers": record.get("workers"), "priority": record.get("priority"), "dag_id": record.get("dag_id"),
        "run_id": record.get("run_id"), "gpu_hours": record.get("gpu_hours"),
        "steps_trained": training.get("steps_trained"), "steps_lost": training.get("steps_lost"),
        "budget_override": record.get("budget_override"),
        "recorded_at": _when(record.get("recorded_at"), f"run record {record['run_key']}: recorded_at"),
    }


def ingest_run_record(record: Mapping[str, Any], *, engine: Engine | None = None) -> int:
    """Put a run record (hybridflow.records.build_record) in the ledger; returns the attempts stored.

    Everything is checked before anything is written, and the run's earlier rows are replaced in
    the same transaction, so ingesting a record again changes nothing.
    """
    from hybridflow.ledger.engine import default_engine

    run, attempts = run_row(record), attempt_rows(record)
    engine = engine or default_engine()
    with Session(engine) as session, session.begin():
        session.merge(Run(**run))
        session.execute(delete(Attempt).where(Attempt.run_key == run["run_key"]))
        session.add_all(Attempt(**a) for a in attempts)
    return len(attempts)
