"""Per-project quotas on bytes held and bytes moved (projects.yaml ``storage_gib`` and
``transfer_gib_per_month``), and what admission does with them.

Usage comes from the ledger: the bytes held are the nightly count (``quota_usage``, see
:mod:`hybridflow.budgets.quota_nightly`) plus what was staged since that count; the bytes moved are
the ``transfer`` rows of the calendar month (UTC). A run that may be placed on a public cluster
stages its dataset into that cluster's cache, so it is refused when the dataset's size on top of
either figure would pass the quota. Nothing here writes: a refused run leaves no trace.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from hybridflow.config import Estate
from hybridflow.errors import AdmissionError

GIB = 1024**3
STORAGE, TRANSFER = "storage_gib", "transfer_gib_per_month"
QUOTAS = (STORAGE, TRANSFER)


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:,.2f} GiB"


@dataclass(frozen=True)
class Usage:
    storage_bytes: int
    transfer_bytes: int  # this calendar month
    counted_on: str | None = None  # the nightly count the storage figure starts from

    def of(self, quota: str) -> int:
        return self.storage_bytes if quota == STORAGE else self.transfer_bytes


def quota_of(estate: Estate, project: str, quota: str) -> float | None:
    return getattr(estate.projects[project], quota)


def usage_of(engine, project: str, today: date) -> Usage:
    """The project's bytes held (the latest nightly count on or before ``today`` plus what was staged
    after it) and moved this month; zero where the ledger holds nothing yet."""
    from sqlalchemy import inspect, select

    from hybridflow.ledger.models import QuotaUsageRow
    from hybridflow.ledger.transfers import transferred_bytes

    if engine is None or not inspect(engine).has_table("transfer"):
        return Usage(0, 0)
    with engine.connect() as conn:
        row = conn.execute(
            select(QuotaUsageRow.day, QuotaUsageRow.storage_bytes)
            .where(QuotaUsageRow.project == project, QuotaUsageRow.day <= today.isoformat())
            .order_by(QuotaUsageRow.day.desc()).limit(1)
        ).first()
    counted_on, held = (row[0], int(row[1])) if row else (None, 0)
    since = date.fromisoformat(counted_on) + timedelta(days=1) if counted_on else date.min
    held += transferred_bytes(engine, since=since, until=today, project=project, kinds=("staging",)).get(project, 0)
    moved = transferred_bytes(engine, since=today.replace(day=1), until=today, project=project).get(project, 0)
    return Usage(held, moved, counted_on)


def stages_data(run, estate: Estate) -> bool:
    """Whether ``run`` may be placed where its data is staged: a public cluster's cloud cache."""
    if run.must_stay_private or run.cluster_preference not in ("auto", "public"):
        return False
    return any(not c.is_private and c.cache is not None and c.peacetime_allows(run.priority)
               for c in estate.clusters.values())


def _refusal(quota: str, project: str, dataset: str, size: int, usage: Usage, limit: float, today: date) -> str:
    key = f"projects.{project}.{quota}"
    if quota == STORAGE:
        counted = f" (counted on {usage.counted_on}, plus what was staged since)" if usage.counted_on else ""
        have = f"holds {gib(usage.storage_bytes)} in the cloud caches and DR stores{counted}"
        later = ("prune old dataset versions with `hybridflow cache prune --cluster <cluster> --dataset "
                 f"{dataset}`")
    else:
        nxt = date(today.year + today.month // 12, today.month % 12 + 1, 1)
        have = f"has transferred {gib(usage.transfer_bytes)} in {today:%Y-%m}"
        later = f"wait for next month (the count starts again on {nxt.isoformat()})"
    return (f"project {project!r} {have}; staging dataset {dataset!r} ({gib(size)}) would take it past "
            f"{key} = {limit:g} GiB in projects.yaml. Raise {key}, {later}, or set cluster_preference=private "
            "so that nothing is staged")


def refuse_over_quota(run, estate: Estate, dataset_bytes: Callable[[], int], *, engine=None,
                      today: date | None = None) -> None:
    """Raise :class:`AdmissionError` if staging ``run``'s dataset (``dataset_bytes()``, its full size:
    admission does not look into the caches) would take its project past a quota. ``engine``: the
    ledger (default: the existing one, opened without migrating; none yet means no usage)."""
    limits = {q: quota_of(estate, run.project, q) for q in QUOTAS}
    if all(v is None for v in limits.values()) or not stages_data(run, estate):
        return
    today = today or datetime.now(UTC).date()
    if engine is None:
        from hybridflow.budgets.enforce import default_store

        store = default_store()
        engine = store.engine if store is not None else None
    usage = usage_of(engine, run.project, today)
    size = int(dataset_bytes())
    for quota, limit in limits.items():
        if limit is not None and usage.of(quota) + size > limit * GIB:
            raise AdmissionError("cluster_preference", _refusal(quota, run.project, run.dataset, size, usage, limit,
                                                                today))


def month_figures(engine, estate: Estate, period: str) -> list[dict]:
    """Per project, for the costs page: the newest nightly count in ``period`` (``YYYY-MM``), the month's
    storage and transfer cost so far, the quota notifications sent and the GPU spend allocated, each
    quota's share and whether staging is refused (at 100 %). Empty when nothing was counted."""
    from sqlalchemy import func, inspect, select

    from hybridflow.ledger.models import Allocation, QuotaNotificationRow, QuotaUsageRow

    if engine is None or not inspect(engine).has_table(QuotaUsageRow.__tablename__):
        return []
    start, end = f"{period}-01", f"{period}-99"
    in_month = (QuotaUsageRow.day >= start, QuotaUsageRow.day <= end)
    with engine.connect() as conn:
        newest = conn.execute(select(func.max(QuotaUsageRow.day)).where(*in_month)).scalar()
        if newest is None:
            return []
        latest = conn.execute(select(QuotaUsageRow).where(QuotaUsageRow.day == newest)
                              .order_by(QuotaUsageRow.project)).mappings().all()
        cost = dict(conn.execute(select(QuotaUsageRow.project, func.sum(QuotaUsageRow.storage_usd
                                                                        + QuotaUsageRow.transfer_usd))
                                 .where(*in_month).group_by(QuotaUsageRow.project)).all())
        notes: dict[tuple[str, str], list[float]] = {}
        for p, q, t in conn.execute(select(QuotaNotificationRow.project, QuotaNotificationRow.quota,
                                           QuotaNotificationRow.threshold)
                                    .where(QuotaNotificationRow.period == period)
                                    .order_by(QuotaNotificationRow.threshold)):
            notes.setdefault((p, q), []).append(t)
        gpu = dict(conn.execute(select(Allocation.project, func.sum(Allocation.cost_usd))
                                .where(Allocation.day >= start, Allocation.day <= end)
                                .group_by(Allocation.project)).all())
    out = []
    for r in latest:
        row = {"project": r["project"], "day": r["day"], "gpu_usd": float(gpu.get(r["project"]) or 0.0),
               "storage_transfer_usd": round(float(cost.get(r["project"]) or 0.0), 6)}
        for quota, used, limit in ((STORAGE, r["storage_bytes"], r["storage_quota_gib"]),
                                   (TRANSFER, r["transfer_bytes_month"], r["transfer_quota_gib"])):
            share = used / (limit * GIB) if limit else None
            row[quota] = {"bytes": int(used), "quota_gib": limit, "share": share,
                          "notified": notes.get((r["project"], quota), []),
                          "frozen": share is not None and share >= 1}
        out.append(row)
    return out
