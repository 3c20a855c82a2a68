"""A project's spend in a budget period, read from the nightly allocation in the ledger.

Spend is the allocated cost (GPUs held x wall time x price, every attempt) of the project's runs
on the days of the month allocated so far; idle cost of owned capacity goes to teams, not projects,
so it does not count against a project's budget.
"""

from __future__ import annotations

from sqlalchemy import Engine, inspect, text

from hybridflow.budgets.config import period_end
from hybridflow.errors import HybridFlowError

# The ledger's allocation table: one row per day, project, team, cluster, GPU model and pricing class.
ALLOCATION_TABLE = "allocation"


class LedgerError(HybridFlowError):
    """The ledger lacks what the budget evaluation reads."""


def require_allocation(engine: Engine) -> None:
    """Raise :class:`LedgerError` unless the ledger at ``engine`` has the allocation table."""
    with engine.connect() as conn:
        _require_allocation(conn, engine)


def _require_allocation(conn, engine: Engine) -> None:
    if not inspect(conn).has_table(ALLOCATION_TABLE):
        raise LedgerError(
            f"the ledger at {engine.url.render_as_string(hide_password=True)} has no {ALLOCATION_TABLE!r} "
            "table: run the nightly allocation (gpu_cost_nightly) first, or point HYBRIDFLOW_LEDGER_URL "
            "at the ledger it writes"
        )


def allocated_spend(engine: Engine, project: str, period: str) -> float:
    """USD allocated to ``project`` on the days of ``period`` (``YYYY-MM``) allocated so far."""
    start = f"{period}-01"
    end = period_end(period).isoformat()
    query = text(
        f"SELECT COALESCE(SUM(cost_usd), 0) FROM {ALLOCATION_TABLE} "
        "WHERE project = :project AND day >= :start AND day < :end"
    )
    with engine.connect() as conn:
        _require_allocation(conn, engine)
        return float(conn.execute(query, {"project": project, "start": start, "end": end}).scalar_one())
