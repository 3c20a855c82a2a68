"""The nightly allocation task: which day a DAG run allocates, then allocate it."""

from __future__ import annotations

from datetime import date, datetime, timedelta


def day_to_allocate(day_param: str | None, interval_start: datetime | None, logical_date: datetime | None,
                    run_after: datetime) -> date:
    """The ``day`` Param, else the start of the run's data interval (a scheduled or backfilled day), else
    the day before ``run_after`` (a manual run without a data interval)."""
    if day_param:
        try:
            return date.fromisoformat(day_param)
        except ValueError:
            raise ValueError(f"Param day: {day_param!r} is not a date; use YYYY-MM-DD") from None
    when = interval_start or logical_date
    return when.date() if when is not None else (run_after - timedelta(days=1)).date()


def allocate_for_run(day_param, interval_start, logical_date, run_after) -> dict:
    from hybridflow.ledger.allocation import allocate_day

    return allocate_day(day_to_allocate(day_param, interval_start, logical_date, run_after))
