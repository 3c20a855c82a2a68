"""The nightly count of each project's bytes held and moved against its quotas: one ``quota_usage``
row per project and day with the day's cost, and the quota notifications (80 % and 100 %, once per
project, month and quota, through the budgets' webhook Connection).

Storage is counted from the manifests of every public cluster's cache and every DR store as they are
when the count runs (:mod:`hybridflow.budgets.storage_usage`); transfers are the ledger's ``transfer``
rows. A day counted again replaces its rows in one transaction.
"""

from __future__ import annotations

import calendar
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, delete, insert
from sqlalchemy.exc import IntegrityError

from hybridflow.budgets.quotas import GIB, QUOTAS, STORAGE, TRANSFER, gib
from hybridflow.config import Estate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuotaUsage:
    day: str
    project: str
    storage_bytes: int
    transfer_bytes_day: int
    transfer_bytes_month: int
    storage_quota_gib: float | None
    transfer_quota_gib: float | None
    storage_usd: float
    transfer_usd: float

    def usage(self, quota: str) -> int:
        return self.storage_bytes if quota == STORAGE else self.transfer_bytes_month

    def limit(self, quota: str) -> float | None:
        return self.storage_quota_gib if quota == STORAGE else self.transfer_quota_gib


def counted_places(estate: Estate) -> list:
    """The clusters whose store is counted: public clusters' caches and DR stores."""
    return [c for c in estate.clusters.values() if c.cache is not None and (not c.is_private or c.is_dr)]


def wanted(estate: Estate) -> bool:
    """Whether there is anything to count for: a quota, or a storage or egress price."""
    return (any(getattr(p, q) is not None for p in estate.projects.values() for q in QUOTAS)
            or any(c.storage_usd_per_gib_month or c.egress_usd_per_gib for c in estate.clusters.values()))


def count_usage(day: date, estate: Estate, engine: Engine, stores: Mapping[str, Any],
                records: Iterable[Mapping[str, Any]]) -> list[QuotaUsage]:
    """Each project's figures for ``day`` (``stores``: place -> its object store)."""
    from hybridflow.budgets.storage_usage import held_bytes, owners_from
    from hybridflow.ledger.transfers import transferred_bytes, transfers_in

    staged = transfers_in(engine, date.min, day, kinds=("staging",))
    owners = owners_from(records, staged, {n: m.project for n, m in estate.models.models.items()})
    held = held_bytes(stores, owners, estate.datasets.datasets)
    month = transferred_bytes(engine, since=day.replace(day=1), until=day)
    moved: dict[str, list] = {}
    for t in transfers_in(engine, day, day):
        moved.setdefault(t.project, []).append(t)
    days_in_month = calendar.monthrange(day.year, day.month)[1]
    clusters = estate.clusters
    out = []
    for project in sorted(set(estate.projects) | set(held) | set(month)):
        places = held.get(project, {})
        quotas = estate.projects.get(project)
        storage_usd = sum(b / GIB * clusters[p].storage_usd_per_gib_month for p, b in places.items()
                          if p in clusters) / days_in_month
        transfer_usd = sum(t.bytes / GIB * clusters[t.cluster].egress_usd_per_gib for t in moved.get(project, ())
                           if t.cluster in clusters)
        out.append(QuotaUsage(
            day=day.isoformat(), project=project, storage_bytes=sum(places.values()),
            transfer_bytes_day=sum(t.bytes for t in moved.get(project, ())),
            transfer_bytes_month=month.get(project, 0),
            storage_quota_gib=quotas.storage_gib if quotas else None,
            transfer_quota_gib=quotas.transfer_gib_per_month if quotas else None,
            storage_usd=round(storage_usd, 6), transfer_usd=round(transfer_usd, 6),
        ))
    return out


def record_served(day: date, serving_root: Path, engine: Engine, private_root: Path | None, *,
                  today: date | None = None) -> int:
    """Record the bytes the model gateway sent out on ``day`` as ``serving`` transfers of the projects
    whose runs deployed the versions; returns how many were recorded. Only a finished day: a transfer
    is recorded once, so a day still being served would keep its first, partial figure."""
    from hybridflow.ledger.inference import version_owners
    from hybridflow.ledger.transfers import Transfer, record_transfer
    from hybridflow.serving.egress import served_bytes

    if day >= (today or datetime.now(UTC).date()):
        log.info("%s has not ended: the bytes served that day are recorded by the count of a later night", day)
        return 0
    served = served_bytes(serving_root, day)
    owners = version_owners(engine, private_root, {version for _, version in served})
    recorded = 0
    for (endpoint, version), n in sorted(served.items()):
        recorded += record_transfer(engine, Transfer(
            key=f"serving/{endpoint}/{version}/{day.isoformat()}", day=day, project=owners[version]["project"],
            kind="serving", cluster="local", bytes=n, version=version))
    return recorded


def replace_day(engine: Engine, day: date, rows: list[QuotaUsage]) -> None:
    """The day's rows, replaced in one transaction."""
    from hybridflow.ledger.models import QuotaUsageRow

    with engine.begin() as conn:
        conn.execute(delete(QuotaUsageRow).where(QuotaUsageRow.day == day.isoformat()))
        if rows:
            conn.execute(insert(QuotaUsageRow), [asdict(r) for r in rows])


def quota_note(row: QuotaUsage, quota: str, threshold: float) -> dict:
    limit = row.limit(quota)
    assert limit is not None
    used, period = row.usage(quota), row.day[:7]
    what = "holds" if quota == STORAGE else f"has transferred in {period}"
    after = ("runs whose staging needs more are refused" if threshold >= 1
             else "at 100 % runs whose staging needs more are refused")
    return {
        "kind": "quota_threshold", "project": row.project, "period": period, "quota": quota,
        "threshold": threshold, "usage_gib": round(used / GIB, 3), "quota_gib": limit,
        "text": (f"Quota: project {row.project} {what} {gib(used)} of its {quota} of {limit:g} GiB "
                 f"({used / (limit * GIB):.0%}, threshold {threshold:.0%}); {after}."),
        "key": f"quota/{row.project}/{period}/{quota}/{threshold:g}",
    }


def notify(engine: Engine, rows: list[QuotaUsage], notify_at: Iterable[float], send: Callable[[dict], None],
           *, at: datetime) -> list[str]:
    """Send each threshold's notification once per project, month and quota; the claim and the send
    share a transaction, so a failed send is tried again next night. Returns the keys sent."""
    from hybridflow.ledger.models import QuotaNotificationRow

    sent = []
    for row in rows:
        for quota in (STORAGE, TRANSFER):
            limit = row.limit(quota)
            if limit is None:
                continue
            share = row.usage(quota) / (limit * GIB)
            for threshold in sorted({*notify_at, 1.0}):
                if share < threshold:
                    continue
                note = quota_note(row, quota, threshold)
                try:
                    with engine.begin() as conn:
                        conn.execute(insert(QuotaNotificationRow).values(
                            project=row.project, period=row.day[:7], quota=quota, threshold=threshold,
                            usage_bytes=row.usage(quota), quota_gib=limit,
                            sent_at=at.astimezone(UTC).replace(tzinfo=None)))
                        send(note)
                except IntegrityError:
                    continue
                sent.append(note["key"])
    return sent


def open_stores(estate: Estate) -> dict[str, Any]:
    """place -> the object store counted there; a store that cannot be opened fails the count (a
    figure without it would read as bytes freed), naming the cluster and its Connection."""
    from hybridflow.errors import ConfigError
    from hybridflow.placement.places import cache_store_spec
    from hybridflow.storage.objectstore import open_store

    stores = {}
    for cluster in counted_places(estate):
        try:
            stores[cluster.name] = open_store(cache_store_spec(cluster))
        except Exception as exc:  # noqa: BLE001 - the hook's own error names what is wrong
            raise ConfigError(f"clusters.{cluster.name}.cache.conn_id: cannot open {cluster.cache.conn_id!r} to count "
                              f"the bytes projects hold there ({type(exc).__name__}: {exc}); define the Connection "
                              "and clear the task") from None
    return stores


def record_quota_usage(day: date, settings=None, *, stores: Mapping[str, Any] | None = None,
                       send: Callable[[dict], None] | None = None, at: datetime | None = None) -> dict:
    """Count, record and notify for ``day`` (the nightly task; safe to clear and re-run)."""
    from hybridflow.budgets.config import load_budgets
    from hybridflow.config import load_estate
    from hybridflow.ledger.engine import default_engine
    from hybridflow.records import read_records
    from hybridflow.settings import get_settings

    settings = settings or get_settings()
    estate = load_estate(settings.config_dir)
    if not wanted(estate):
        log.info("no project has a storage or transfer quota and no cluster prices storage or egress: nothing to "
                 "count for %s", day)
        return {"day": day.isoformat(), "counted": False, "projects": [], "notified": []}
    engine = default_engine()
    at = at or datetime.now(UTC)
    record_served(day, settings.state_dir / "serving", engine, settings.private_root, today=at.date())
    rows = count_usage(day, estate, engine, stores if stores is not None else open_stores(estate),
                       read_records(settings.private_root))
    replace_day(engine, day, rows)
    cfg = load_budgets(settings.config_dir, estate)
    if send is None:
        from hybridflow.budgets.notifier import BudgetWebhookNotifier

        def send(note: dict) -> None:
            BudgetWebhookNotifier(http_conn_id=cfg.webhook_conn_id, text=note["text"], payload=note,
                                  key=note["key"])({})

    sent = notify(engine, rows, cfg.notify_at, send, at=at)
    for r in rows:
        log.info("quota usage %s %s: holds %s, moved %s this month, %.2f USD storage, %.2f USD transfer", r.day,
                 r.project, gib(r.storage_bytes), gib(r.transfer_bytes_month), r.storage_usd, r.transfer_usd)
    return {"day": day.isoformat(), "counted": True, "projects": [asdict(r) for r in rows], "notified": sent}


def quota_usage_for_run(day_param, interval_start, logical_date, run_after) -> dict:
    from hybridflow.ledger.nightly import day_to_allocate

    return record_quota_usage(day_to_allocate(day_param, interval_start, logical_date, run_after))
