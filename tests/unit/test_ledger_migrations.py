"""The ledger's migration chain: the budget tables come from 0002 on a fresh ledger, a ledger the budget
store filled before 0002 existed upgrades keeping its rows, 0003 adds the queue waits, and both go back
down cleanly."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text
from tests.support.ledger_db import postgres_engine

from hybridflow.budgets.store import BudgetStore
from hybridflow.ledger import upgrade
from hybridflow.ledger.budget_tables import budget_metadata
from hybridflow.ledger.models import Base

AT = datetime(2026, 12, 20, 3, 0, tzinfo=UTC)
BUDGET_TABLES = {"budget_state", "budget_notification"}
LEDGER_TABLES = {"run", "attempt", "gpu_sample", "price", "allocation", "idle_allocation"}
WAIT_TABLES = {"queue_waits"}  # 0003
HEAD = "0008"
# Not the ledger tests' schema: these tests start each database empty and must not drop theirs.
PG_SCHEMA = "hybridflow_ledger_migration_test"


@pytest.fixture(params=["sqlite", "postgresql"])
def blank_engine(request, tmp_path):
    """An empty database, at no revision."""
    if request.param == "sqlite":
        engine = create_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    else:
        engine = postgres_engine(PG_SCHEMA)
    yield engine
    engine.dispose()


def _tables(engine) -> set[str]:
    return set(inspect(engine).get_table_names())


def _revision(engine) -> list[str]:
    with engine.connect() as conn:
        return conn.execute(text("SELECT version_num FROM hybridflow_ledger_version")).scalars().all()


def downgrade(engine, revision: str) -> None:
    from alembic import command

    from hybridflow.ledger.migrate import _config

    with engine.begin() as conn:
        command.downgrade(_config(conn), revision)


def test_a_fresh_ledger_used_only_for_budgets_gets_every_table_at_head(blank_engine):
    store = BudgetStore(blank_engine)
    assert not store.has_schema()
    store.ensure_schema()
    store.ensure_schema()  # idempotent
    assert BUDGET_TABLES | LEDGER_TABLES | WAIT_TABLES <= _tables(blank_engine)
    assert _revision(blank_engine) == [HEAD]
    store.record("ranking", "2026-12", budget_usd=8000, spend_usd=100, frozen=False, reason=None, at=AT)
    assert store.get("ranking", "2026-12").spend_usd == 100


def test_head_matches_the_models_and_the_budget_tables_store_py_defines(blank_engine):
    upgrade(blank_engine)
    with blank_engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": "hybridflow_ledger_version"})
        diff = compare_metadata(context, [Base.metadata, budget_metadata])
    assert diff == []


def test_a_0001_ledger_with_budget_tables_made_by_the_old_store_upgrades_keeping_its_rows(blank_engine):
    upgrade(blank_engine, "0001")
    budget_metadata.create_all(blank_engine)  # what BudgetStore.ensure_schema did before 0002
    store = BudgetStore(blank_engine)
    reason = "project 'digits-ocr' has spent 25,010.00 USD of its 25,000.00 USD budget for 2026-12"
    store.record("digits-ocr", "2026-12", budget_usd=25_000, spend_usd=25_010, frozen=True, reason=reason, at=AT)
    assert store.notify_once("digits-ocr", "2026-12", 0.8, spend_usd=20_000, budget_usd=25_000, send=lambda: None)
    assert _revision(blank_engine) == ["0001"]

    store.ensure_schema()
    assert _revision(blank_engine) == [HEAD]
    state = store.get("digits-ocr", "2026-12")
    assert state is not None and state.frozen and state.reason == reason and state.frozen_at == AT
    assert state.notified == (0.8,)


def test_downgrade_to_0001_drops_the_budget_tables_and_keeps_the_ledger(blank_engine):
    upgrade(blank_engine)
    with blank_engine.begin() as conn:
        conn.execute(text("INSERT INTO run (run_key, project) VALUES ('r1', 'ranking')"))
    downgrade(blank_engine, "0001")
    tables = _tables(blank_engine)
    assert not tables & (BUDGET_TABLES | WAIT_TABLES) and LEDGER_TABLES <= tables
    assert _revision(blank_engine) == ["0001"]
    with blank_engine.connect() as conn:
        assert conn.execute(text("SELECT run_key FROM run")).scalars().all() == ["r1"]
    upgrade(blank_engine)  # and up again
    assert BUDGET_TABLES | WAIT_TABLES <= _tables(blank_engine) and _revision(blank_engine) == [HEAD]


def test_0003_adds_the_queue_waits_table_to_a_0002_ledger_and_goes_back_down(blank_engine):
    upgrade(blank_engine, "0002")
    with blank_engine.begin() as conn:
        conn.execute(text("INSERT INTO run (run_key, project) VALUES ('r1', 'ranking')"))
    assert not _tables(blank_engine) & WAIT_TABLES

    upgrade(blank_engine)
    assert WAIT_TABLES <= _tables(blank_engine) and _revision(blank_engine) == [HEAD]
    indexes = {ix["name"]: ix["column_names"] for ix in inspect(blank_engine).get_indexes("queue_waits")}
    assert indexes["ix_queue_waits_cluster_queued_at"] == ["cluster", "queued_at"]
    uniques = [u["column_names"] for u in inspect(blank_engine).get_unique_constraints("queue_waits")]
    assert uniques == [["run_key", "attempt", "cluster"]]

    downgrade(blank_engine, "0002")
    tables = _tables(blank_engine)
    assert not tables & WAIT_TABLES and BUDGET_TABLES | LEDGER_TABLES <= tables
    assert _revision(blank_engine) == ["0002"]
    with blank_engine.connect() as conn:
        assert conn.execute(text("SELECT run_key FROM run")).scalars().all() == ["r1"]
