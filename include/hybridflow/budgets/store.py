"""Budget state in the ledger database: per project and month, whether it is frozen and why, and
which notification thresholds have gone out.

One row per (project, period) in ``budget_state`` and one per (project, period, threshold) in
``budget_notification``; the primary keys make a re-run evaluation update instead of append, and
make a threshold's notification claimable once.

The tables are the ledger's (hybridflow.ledger.budget_tables, created by its migration 0002); this module
only queries them, so budgets depend on the ledger and never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Engine, insert, select, update
from sqlalchemy.exc import IntegrityError

from hybridflow.ledger.budget_tables import budget_metadata as metadata  # noqa: F401 (re-exported)
from hybridflow.ledger.budget_tables import budget_notification, budget_state


@dataclass(frozen=True)
class BudgetState:
    project: str
    period: str
    budget_usd: float
    spend_usd: float
    frozen: bool
    reason: str | None
    frozen_at: datetime | None
    lifted_at: datetime | None
    evaluated_at: datetime
    notified: tuple[float, ...] = ()

    @property
    def share(self) -> float:
        return self.spend_usd / self.budget_usd if self.budget_usd else 0.0


def _state(row, notified: tuple[float, ...]) -> BudgetState:
    # SQLite hands back naive datetimes for timezone-aware columns; every time here is UTC.
    values = {k: (v.replace(tzinfo=UTC) if isinstance(v, datetime) and v.tzinfo is None else v)
              for k, v in dict(row).items()}
    return BudgetState(**values, notified=notified)


class BudgetStore:
    """Reads and writes budget state through a SQLAlchemy engine (the ledger's)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def ensure_schema(self) -> None:
        """Bring the ledger to its latest schema, budget tables included (a no-op once it is there).

        Through the ledger's migrations, not ``create_all``, so the version table stays in step and a
        database used only for budgets is a ledger like any other."""
        from hybridflow.ledger.migrate import upgrade

        upgrade(self.engine)

    def has_schema(self) -> bool:
        """Whether the budget tables exist (not before the first budget evaluation)."""
        from sqlalchemy import inspect

        return inspect(self.engine).has_table(budget_state.name)

    def get(self, project: str, period: str) -> BudgetState | None:
        with self.engine.connect() as conn:
            row = conn.execute(
                select(budget_state).where(budget_state.c.project == project, budget_state.c.period == period)
            ).mappings().first()
            if row is None:
                return None
            return _state(row, self._notified(conn, project, period))

    def all(self, period: str) -> list[BudgetState]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(budget_state).where(budget_state.c.period == period).order_by(budget_state.c.project)
            ).mappings().all()
            return [_state(r, self._notified(conn, r["project"], period)) for r in rows]

    def latest_period(self) -> str | None:
        with self.engine.connect() as conn:
            return conn.execute(select(budget_state.c.period).order_by(budget_state.c.period.desc())).scalar()

    @staticmethod
    def _notified(conn, project: str, period: str) -> tuple[float, ...]:
        rows = conn.execute(
            select(budget_notification.c.threshold)
            .where(budget_notification.c.project == project, budget_notification.c.period == period)
            .order_by(budget_notification.c.threshold)
        ).scalars()
        return tuple(rows)

    def record(
        self,
        project: str,
        period: str,
        *,
        budget_usd: float,
        spend_usd: float,
        frozen: bool,
        reason: str | None,
        at: datetime,
    ) -> BudgetState:
        """Upsert the state of one project and period. ``frozen_at`` keeps the first freeze time;
        ``lifted_at`` is set when a frozen project is no longer frozen."""
        with self.engine.begin() as conn:
            old = conn.execute(
                select(budget_state).where(budget_state.c.project == project, budget_state.c.period == period)
            ).mappings().first()
            values = {"budget_usd": budget_usd, "spend_usd": spend_usd, "frozen": frozen, "evaluated_at": at}
            if frozen:
                values["reason"] = reason
                values["frozen_at"] = old["frozen_at"] if old and old["frozen"] else at
                values["lifted_at"] = None
            elif old and old["frozen"]:
                values.update(reason=reason, lifted_at=at)
            if old is None:
                conn.execute(insert(budget_state).values(project=project, period=period, **values))
            else:
                conn.execute(
                    update(budget_state)
                    .where(budget_state.c.project == project, budget_state.c.period == period)
                    .values(**values)
                )
        state = self.get(project, period)
        assert state is not None
        return state

    def notify_once(
        self,
        project: str,
        period: str,
        threshold: float,
        *,
        spend_usd: float,
        budget_usd: float,
        send: Callable[[], None],
        at: datetime | None = None,
    ) -> bool:
        """Send the notification for ``threshold`` unless it went out before in this period.

        The row is inserted and ``send`` runs inside one transaction: if sending fails the claim is
        rolled back and the next evaluation sends again; a concurrent evaluation hits the primary key
        and sends nothing. Returns True if this call sent it.
        """
        at = at or datetime.now(UTC)
        try:
            with self.engine.begin() as conn:
                conn.execute(
                    insert(budget_notification).values(
                        project=project, period=period, threshold=threshold,
                        spend_usd=spend_usd, budget_usd=budget_usd, sent_at=at,
                    )
                )
                send()
        except IntegrityError:
            return False
        return True
