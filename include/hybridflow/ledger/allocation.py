"""The nightly cost allocation of one day: what every attempt held, what it used, what it cost, and
who pays for the owned capacity nobody used.

For the day [00:00, 24:00) UTC:
* allocated GPU-hours = GPUs held x the attempt's overlap with the day, for every attempt (failed,
  preempted, stopped ones too), priced from the ledger's versioned price catalog;
* effective GPU-hours = allocated x the run's mean utilisation over its samples of the day;
* waste: an attempt holding >= WASTE_MIN_GPUS GPUs at < WASTE_MAX_UTIL_PCT mean utilisation;
* preempted GPU-hours: the share of a preempted attempt's hours spent on steps the next attempt redid;
* idle: owned (onprem-billed) private capacity x 24 h minus what was allocated on it, billed to teams by
  guaranteed_share and the rest to PLATFORM, so allocated + idle = capacity cost;
* inference: what the serving meter sampled (slots or GPUs per model version, hybridflow.ledger.inference),
  one line per project and model version, whose sum is the metered inference cost of the day.
Re-running a day replaces its rows in one transaction.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

from sqlalchemy import Engine, delete, insert, select

from hybridflow.errors import HybridFlowError
from hybridflow.ledger.inference import inference_lines, metered_cost
from hybridflow.ledger.models import Allocation, Attempt, IdleAllocation, InferenceAllocation, Price, Run
from hybridflow.storage.objectstore import LocalObjectStore, ObjectStore

log = logging.getLogger(__name__)

PLATFORM = "(platform)"
WASTE_MIN_GPUS = 4
WASTE_MAX_UTIL_PCT = 10.0
CATALOG_START = "1970-01-01"  # first catalog version: applies to every day before a price change
PRICE_SOURCE = "config/clusters.yaml"
REPORTS = Path("reports") / "allocation"  # key prefix in the store; the cost UI reads <day>/report.html
SAMPLE_EXPORTS = Path("ledger") / "samples"  # under private storage: <day>.parquet
CONSERVATION_RTOL = 1e-9


class AllocationError(HybridFlowError):
    """The day cannot be allocated as asked."""


@dataclass
class AttemptCost:
    day: str
    run_key: str
    dag_id: str | None
    run_id: str | None
    try_number: int | None
    attempt: str | None
    outcome: str
    project: str
    team: str
    cluster: str
    gpu_model: str
    pricing_class: str
    gpus: int
    gpu_hours: float
    usd_per_gpu_hour: float
    cost_usd: float
    mean_util_pct: float | None
    effective_gpu_hours: float | None
    waste: bool
    preempted_gpu_hours: float


def sync_prices(engine: Engine, estate, as_of: date) -> int:
    """Add a catalog version for each configured price that differs from the one in force; returns how many.

    The first version of a price applies from CATALOG_START; a changed one from ``as_of``, so days
    allocated again later keep the price they had. Only the configured versions are compared: a price
    imported from a price table (hybridflow.ledger.prices) stays in force until the configured price
    changes.
    """
    added = 0
    with engine.begin() as conn:
        for cluster in estate.clusters.values():
            for pool in cluster.node_pools:
                pclass = cluster.pricing_class(pool)
                usd = cluster.prices[pclass]
                current = _price_row(conn, cluster.name, pclass, pool.gpu_model, as_of.isoformat(), PRICE_SOURCE)
                if current is not None and current.usd_per_gpu_hour == usd:
                    continue
                valid_from = CATALOG_START if current is None else as_of.isoformat()
                conn.execute(delete(Price).where(Price.cluster == cluster.name, Price.pricing_class == pclass,
                                                 Price.gpu_model == pool.gpu_model, Price.valid_from == valid_from))
                conn.execute(insert(Price).values(cluster=cluster.name, pricing_class=pclass, gpu_model=pool.gpu_model,
                                                  usd_per_gpu_hour=usd, valid_from=valid_from, source=PRICE_SOURCE))
                added += 1
    return added


def _price_row(conn, cluster: str, pclass: str, model: str, day: str, source: str | None = None):
    query = select(Price).where(Price.cluster == cluster, Price.pricing_class == pclass, Price.gpu_model == model,
                                Price.valid_from <= day)
    if source is not None:
        query = query.where(Price.source == source)
    return conn.execute(query.order_by(Price.valid_from.desc()).limit(1)).first()


def _pricing_class(estate, row, cluster_name: str) -> str:
    """The run's class where it was placed; for a failover cluster, that cluster's class for the GPU model."""
    if cluster_name == row.run_cluster and row.pricing_class:
        return row.pricing_class
    cluster = estate.clusters.get(cluster_name)
    if cluster is None:
        raise AllocationError(f"attempt of run {row.run_key} ran on cluster {cluster_name!r}, which is not in "
                              "clusters.yaml; add it back (with its prices) to allocate this day")
    pools = [p for p in cluster.node_pools if p.gpu_model == row.gpu_model] or cluster.node_pools
    return cluster.pricing_class(pools[0])


# What the allocation reads of an attempt and its run (Core rows: a day holds thousands of attempts).
_ATTEMPT_COLUMNS = [Attempt.cluster, Attempt.started_at, Attempt.ended_at, Attempt.gpus, Attempt.outcome,
                    Attempt.try_number, Attempt.label, Attempt.start_step, Attempt.last_step, Attempt.steps_lost,
                    Run.run_key, Run.project, Run.team, Run.cluster.label("run_cluster"), Run.gpu_model,
                    Run.pricing_class, Run.dag_id, Run.run_id]


def attempt_costs(engine: Engine, estate, day: date, usage: dict[tuple[date, str], dict]) -> list[AttemptCost]:
    """Every attempt that held GPUs during ``day``, priced; ``usage`` is keyed by (day, run_key)."""
    start = datetime.combine(day, datetime.min.time())
    end = start + timedelta(days=1)
    iso = day.isoformat()
    out = []
    with engine.connect() as conn:
        pairs = conn.execute(
            select(*_ATTEMPT_COLUMNS).join(Run, Run.run_key == Attempt.run_key)
            .where(Attempt.started_at < end, Attempt.ended_at > start)
            .order_by(Attempt.run_key, Attempt.seq)
        ).all()
        prices: dict[tuple, object] = {}  # one catalog look-up per (cluster, class, model) and day
        for a in pairs:
            cluster = a.cluster or a.run_cluster
            if not cluster or not a.gpu_model:
                raise AllocationError(f"run {a.run_key} has no cluster or GPU model in the ledger; re-ingest its "
                                      f"run record (the record step of its DAG run) before allocating {iso}")
            pclass = _pricing_class(estate, a, cluster)
            if (cluster, pclass, a.gpu_model) not in prices:
                prices[(cluster, pclass, a.gpu_model)] = _price_row(conn, cluster, pclass, a.gpu_model, iso)
            price = prices[(cluster, pclass, a.gpu_model)]
            if price is None:
                raise AllocationError(f"no {pclass} price for {a.gpu_model} on {cluster} on {iso}: add it to "
                                      f"clusters.{cluster}.prices in clusters.yaml")
            overlap = (min(a.ended_at, end) - max(a.started_at, start)).total_seconds()
            hours = a.gpus * overlap / 3600.0
            util = (usage.get((day, a.run_key)) or {}).get("mean_util_pct")
            ran = (a.last_step - a.start_step) if a.last_step is not None and a.start_step is not None else 0
            lost = hours * min(1.0, a.steps_lost / ran) if a.outcome == "preempted" and a.steps_lost and ran > 0 else 0.0
            out.append(AttemptCost(
                day=iso, run_key=a.run_key, dag_id=a.dag_id, run_id=a.run_id, try_number=a.try_number,
                attempt=a.label, outcome=a.outcome, project=a.project, team=a.team or "", cluster=cluster,
                gpu_model=a.gpu_model, pricing_class=pclass, gpus=a.gpus, gpu_hours=hours,
                usd_per_gpu_hour=price.usd_per_gpu_hour, cost_usd=hours * price.usd_per_gpu_hour,
                mean_util_pct=util, effective_gpu_hours=None if util is None else hours * util / 100.0,
                waste=util is not None and a.gpus >= WASTE_MIN_GPUS and util < WASTE_MAX_UTIL_PCT,
                preempted_gpu_hours=lost,
            ))
    return out


def group(costs: list[AttemptCost]) -> list[dict]:
    rows: dict[tuple, dict] = {}
    for c in costs:
        key = (c.day, c.project, c.team, c.cluster, c.gpu_model, c.pricing_class)
        row = rows.setdefault(key, dict(zip(("day", "project", "team", "cluster", "gpu_model", "pricing_class"),
                                            key, strict=True), gpu_hours=0.0, effective_gpu_hours=None,
                                        cost_usd=0.0, waste=False, waste_gpu_hours=0.0,
                                        preempted_gpu_hours=0.0, attempts=0))
        row["gpu_hours"] += c.gpu_hours
        row["cost_usd"] += c.cost_usd
        if c.effective_gpu_hours is not None:
            row["effective_gpu_hours"] = (row["effective_gpu_hours"] or 0.0) + c.effective_gpu_hours
        row["waste"] = row["waste"] or c.waste
        row["waste_gpu_hours"] += c.gpu_hours if c.waste else 0.0
        row["preempted_gpu_hours"] += c.preempted_gpu_hours
        row["attempts"] += 1
    return list(rows.values())


def idle_capacity(engine: Engine, estate, day: date, costs: list[AttemptCost]) -> tuple[list[dict], float, float]:
    """Idle rows of owned capacity, its total cost and the allocated cost on it."""
    iso = day.isoformat()
    used: dict[tuple, float] = defaultdict(float)
    for c in costs:
        used[(c.cluster, c.gpu_model, c.pricing_class)] += c.gpu_hours
    shares = {name: t.guaranteed_share for name, t in sorted(estate.teams.items()) if t.guaranteed_share > 0}
    platform = max(0.0, 1.0 - sum(shares.values()))
    rows, capacity_cost, allocated_cost = [], 0.0, 0.0
    with engine.connect() as conn:
        for cluster in estate.private_clusters:
            idle_h = idle_usd = 0.0
            for model in cluster.gpu_models:
                gpus = sum(p.gpus for p in cluster.node_pools if p.gpu_model == model
                           and cluster.pricing_class(p) == "onprem")
                if not gpus:
                    continue
                price = _price_row(conn, cluster.name, "onprem", model, iso)
                if price is None:
                    raise AllocationError(f"no onprem price for {model} on {cluster.name} on {iso}: add "
                                          f"clusters.{cluster.name}.prices.onprem in clusters.yaml")
                held = used.get((cluster.name, model, "onprem"), 0.0)
                capacity = gpus * 24.0
                if held > capacity * (1 + CONSERVATION_RTOL):
                    raise AllocationError(
                        f"{iso}: attempts on {cluster.name} held {held:.3f} {model} GPU-hours, more than its "
                        f"{capacity:.0f} GPU-hours of capacity; attempts overlap (check the run records' attempts)")
                idle_h += max(0.0, capacity - held)
                idle_usd += max(0.0, capacity - held) * price.usd_per_gpu_hour
                capacity_cost += capacity * price.usd_per_gpu_hour
                allocated_cost += held * price.usd_per_gpu_hour
            for team, share in [*shares.items(), (PLATFORM, platform)]:
                if share > 0:
                    rows.append({"day": iso, "team": team, "cluster": cluster.name, "gpu_hours": idle_h * share,
                                 "cost_usd": idle_usd * share})
    return rows, capacity_cost, allocated_cost


def allocate_day(day: date, *, engine: Engine | None = None, estate=None, private_root: Path | None = None,
                 as_of: date | None = None, report: bool = True, samples: Sequence[Path] | None = None,
                 store: ObjectStore | None = None) -> dict:
    """Allocate ``day`` into the ledger and object storage; returns a summary (for XCom).

    ``samples``: Parquet files holding the day's samples (EXPORT_COLUMNS), read in place; by default
    the day's samples are exported from the ledger to private storage first. ``store``: where the
    CSV/Parquet files and the report go (default: private storage, where the cost page reads them).
    """
    return allocate_days([day], engine=engine, estate=estate, private_root=private_root, as_of=as_of,
                         report=report, samples=samples, store=store)[0]


def allocate_days(days: Sequence[date], *, engine: Engine | None = None, estate=None,
                  private_root: Path | None = None, as_of: date | None = None, report: bool = True,
                  samples: Sequence[Path] | None = None, store: ObjectStore | None = None) -> list[dict]:
    """Allocate each of ``days`` as allocate_day does, aggregating their samples in one DuckDB pass
    (a backfill of a month reads its Parquet files once)."""
    from hybridflow.config import load_estate
    from hybridflow.ledger.engine import default_engine
    from hybridflow.ledger.usage import export_day, usage_by_day_and_run
    from hybridflow.settings import get_settings

    settings = get_settings()
    engine = engine or default_engine()
    estate = estate or load_estate(settings.config_dir)
    private_root = private_root or settings.private_root
    store = store or LocalObjectStore(private_root)
    sync_prices(engine, estate, as_of or datetime.now(UTC).date())
    counts: dict[date, int | None] = dict.fromkeys(days)  # read in place: not counted
    if samples is None:
        samples = []
        for day in days:
            export = private_root / SAMPLE_EXPORTS / f"{day.isoformat()}.parquet"
            counts[day] = export_day(engine, day, export)
            if counts[day]:
                samples.append(export)
    usage = usage_by_day_and_run(samples)
    return [_allocate(day, engine, estate, store, usage, counts[day], report, private_root) for day in days]


def _inference(engine: Engine, day: date, private_root: Path | None) -> list[dict]:
    """The day's inference lines, checked to add up to what the serving meter recorded."""
    lines = inference_lines(engine, day, private_root)
    metered, allocated = metered_cost(engine, day), sum(x["cost_usd"] for x in lines)
    if abs(allocated - metered) > CONSERVATION_RTOL * max(1.0, metered):
        raise AllocationError(f"{day}: inference lines {allocated} != metered inference cost {metered}")
    return lines


def _allocate(day: date, engine: Engine, estate, store: ObjectStore, usage: dict, sample_count: int | None,
              report: bool, private_root: Path | None = None) -> dict:
    costs = attempt_costs(engine, estate, day, usage)
    rows = group(costs)
    idle, capacity_cost, allocated_private = idle_capacity(engine, estate, day, costs)
    idle_cost = sum(r["cost_usd"] for r in idle)
    error = abs(allocated_private + idle_cost - capacity_cost) / capacity_cost if capacity_cost else 0.0
    if error > CONSERVATION_RTOL:
        raise AllocationError(f"{day}: allocated {allocated_private} + idle {idle_cost} != capacity {capacity_cost}")
    inference = _inference(engine, day, private_root)
    with engine.begin() as conn:  # the day's partition, replaced as a whole
        for table in (Allocation, IdleAllocation, InferenceAllocation):
            conn.execute(delete(table).where(table.day == day.isoformat()))
        for table, data in ((Allocation, rows), (IdleAllocation, idle), (InferenceAllocation, inference)):
            if data:
                conn.execute(insert(table), data)
    prefix = f"{REPORTS.as_posix()}/{day.isoformat()}"
    write_files(store, prefix, rows, idle, [dict(vars(c)) for c in costs], inference)
    if report:
        from hybridflow.ledger.report import REPORT_FILE, render_report

        page = render_report(engine, day, rows, idle, costs, inference)
        store.put_bytes(f"{prefix}/{REPORT_FILE}", page.encode("utf-8"))
    summary = {"day": day.isoformat(), "rows": len(rows), "attempts": len(costs), "samples": sample_count,
               "cost_usd": round(sum(r["cost_usd"] for r in rows), 6), "idle_cost_usd": round(idle_cost, 6),
               "capacity_cost_usd": round(capacity_cost, 6), "conservation_error": error,
               "inference_lines": len(inference),
               "inference_cost_usd": round(sum(x["cost_usd"] for x in inference), 6),
               "waste_attempts": sum(c.waste for c in costs), "files": f"{store.uri.rstrip('/')}/{prefix}"}
    log.info("allocation %s", summary)
    return summary


def write_files(store: ObjectStore, prefix: str, rows: list[dict], idle: list[dict], attempts: list[dict],
                inference: list[dict] | None = None) -> None:
    """CSV and Parquet of the day's allocation, idle capacity, per-attempt detail and inference cost
    lines under ``prefix`` (each object replaced whole)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    for name, data in (("allocation", rows), ("idle", idle), ("attempts", attempts), ("inference", inference or [])):
        table = pa.Table.from_pylist(data) if data else pa.table({})
        for suffix, write in ((".parquet", pq.write_table), (".csv", pacsv.write_csv)):
            buf = pa.BufferOutputStream()
            write(table, buf)
            store.put_bytes(f"{prefix}/{name}{suffix}", buf.getvalue().to_pybytes())
