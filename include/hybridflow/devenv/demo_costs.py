"""GPU metering and cost allocation around a demo run, so its costs are in the ledger when it ends.

On the embedded default nothing schedules ``gpu_metering``, ``gpu_cost_nightly`` and ``gpu_budgets``
while ``hybridflow demo`` runs the pipeline with ``airflow dags test``. This module runs their task
units in the same order, in the demo's own process:

* while the pipeline runs, :class:`DemoMeter` meters every cluster with a metering source every
  few seconds (each pass a window ending now, as a gpu_metering run), so the run's gang is seen;
* after it, :func:`allocate_demo_days` ingests the run records the ledger lacks, allocates each UTC
  day the demo spanned and evaluates the budgets of their months.

Every step is an upsert or a replaced partition: a second demo (or the nightly DAGs later) changes
the figures, never duplicates them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta

# Seconds between metering passes during a demo: its training lasts tens of seconds, not the
# minutes between gpu_metering runs.
METER_EVERY_S = 3.0


@dataclass
class MeterTotals:
    passes: int = 0
    samples: int = 0  # stored (an upsert per sample key)
    attributed: int = 0  # tied to a run's gang
    errors: list[str] = field(default_factory=list)


def meterable_clusters(estate) -> list[str]:
    """The clusters gpu_metering reads anything from: those with a metering source."""
    from hybridflow.metering.collect import source_of

    return sorted(n for n, c in estate.clusters.items() if source_of(c, estate.pipeline.metering) is not None)


class DemoMeter:
    """Meters the clusters in a thread from :meth:`start` to :meth:`stop`, a pass every ``every_s``."""

    def __init__(self, clusters: list[str], *, every_s: float = METER_EVERY_S) -> None:
        self.clusters = clusters
        self.every_s = every_s
        self.totals = MeterTotals()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._window_start = datetime.now(UTC)

    def start(self) -> DemoMeter:
        self._window_start = datetime.now(UTC)
        self._thread = threading.Thread(target=self._loop, name="demo-metering", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> MeterTotals:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.totals

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.meter_once(datetime.now(UTC))

    def meter_once(self, now: datetime) -> None:
        """One pass over the clusters: the window since the previous pass, ending ``now``."""
        from hybridflow.metering.task import meter_cluster

        start, self._window_start = self._window_start, now
        for cluster in self.clusters:
            try:
                summary = meter_cluster(cluster, window_start=start, window_end=now, now=now)
            except Exception as exc:  # noqa: BLE001 - shown in the demo's summary; the next pass tries again
                self.totals.errors.append(f"{cluster} at {now.isoformat(timespec='seconds')}: {exc}")
                continue
            self.totals.samples += summary["stored"]
            self.totals.attributed += summary["attributed"]
            self.totals.errors += [f"{cluster}: {e}" for e in summary["errors"]]
        self.totals.passes += 1


def days_between(first: datetime, last: datetime) -> list[date]:
    """The UTC days from ``first`` to ``last``, both included."""
    day, end = first.astimezone(UTC).date(), last.astimezone(UTC).date()
    return [day + timedelta(days=i) for i in range((end - day).days + 1)]


def allocate_demo_days(days: list[date]) -> dict:
    """What gpu_cost_nightly and then gpu_budgets do for each of ``days``: sync the run records,
    allocate the day, evaluate its month's budgets. Returns their summaries and the days' totals."""
    from sqlalchemy import func, select

    from hybridflow.budgets.config import period_of
    from hybridflow.budgets.nightly import evaluate_budgets
    from hybridflow.ledger.allocation import allocate_day
    from hybridflow.ledger.engine import default_engine
    from hybridflow.ledger.models import Allocation
    from hybridflow.ledger.sync import sync_run_records
    from hybridflow.settings import get_settings

    synced = sync_run_records(get_settings().private_root)
    allocations = [allocate_day(day) for day in days]
    budgets = [evaluate_budgets(period) for period in sorted({period_of(day) for day in days})]
    isos = [day.isoformat() for day in days]
    with default_engine().connect() as conn:
        hours, effective, cost = conn.execute(
            select(func.sum(Allocation.gpu_hours), func.sum(Allocation.effective_gpu_hours),
                   func.sum(Allocation.cost_usd)).where(Allocation.day.in_(isos))
        ).one()
    return {
        "synced": synced.to_json(),
        "allocations": allocations,
        "budgets": budgets,
        "gpu_hours": hours or 0.0,
        "effective_gpu_hours": effective,
        "cost_usd": cost or 0.0,
        "idle_cost_usd": sum(a["idle_cost_usd"] for a in allocations),
    }
