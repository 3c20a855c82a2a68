"""The budget evaluation task: after the nightly allocation, evaluate the month it allocated into."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import UTC, date, datetime
from typing import Any

from hybridflow.budgets import ALLOCATIONS_ASSET  # noqa: F401 (re-exported for callers)
from hybridflow.budgets.config import period_of
from hybridflow.settings import Settings, get_settings

log = logging.getLogger(__name__)



def period_to_evaluate(asset_events: Mapping[Any, Iterable[Any]] | None, run_after: datetime | date) -> str:
    """The month of the newest allocated day named by the triggering asset events, else of ``run_after``
    (a manual run evaluates the current month)."""
    days = []
    for events in (asset_events or {}).values():
        for event in events:
            day = (getattr(event, "extra", None) or {}).get("day")
            if day:
                days.append(date.fromisoformat(str(day)[:10]))
    return period_of(max(days) if days else run_after)


def evaluate_budgets(period: str, settings: Settings | None = None, *, at: datetime | None = None) -> dict:
    """Evaluate every budgeted project for ``period`` against the ledger and act on it."""
    from sqlalchemy import create_engine

    from hybridflow.budgets.config import load_budgets
    from hybridflow.budgets.enforce import ledger_url, stop_interruptible_gangs
    from hybridflow.budgets.evaluate import evaluate_period
    from hybridflow.budgets.notifier import BudgetWebhookNotifier
    from hybridflow.budgets.spend import allocated_spend, require_allocation
    from hybridflow.budgets.store import BudgetStore
    from hybridflow.config import load_estate

    settings = settings or get_settings()
    estate = load_estate(settings.config_dir)
    cfg = load_budgets(settings.config_dir, estate)
    engine = create_engine(ledger_url(settings.home))

    def send(note: dict) -> None:
        BudgetWebhookNotifier(http_conn_id=cfg.webhook_conn_id, text=note["text"], payload=note, key=note["key"])({})

    # Before migrating: a URL that names no allocated ledger gets the error saying what to run, not a
    # new empty ledger that reads as zero spend.
    require_allocation(engine)
    store = BudgetStore(engine)
    store.ensure_schema()
    outcomes = evaluate_period(
        period,
        cfg,
        store,
        spend=lambda project, p: allocated_spend(engine, project, p),
        send=send,
        stop_gangs=lambda project, reason: stop_interruptible_gangs(project, reason, estate, settings.state_dir),
        at=at or datetime.now(UTC),
    )
    for o in outcomes:
        log.info(
            "budget %s %s: %.2f of %.2f USD (%.1f%%)%s%s%s", o.project, period, o.spend_usd, o.budget_usd,
            100 * o.share, " FROZEN" if o.frozen else "", f", notified {o.notified}" if o.notified else "",
            f", stopped {o.stopped}" if o.stopped else "",
        )
    return {"period": period, "projects": [o.to_xcom() for o in outcomes]}
