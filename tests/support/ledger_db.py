"""Ledger databases for the ledger tests: a SQLite file, and PostgreSQL in its own schema when reachable."""

from __future__ import annotations

import os

import pytest
from sqlalchemy import create_engine, text

# Another database (e.g. one made with createdb) keeps a run off the schemas of others sharing the server.
PG_URL = os.environ.get("HYBRIDFLOW_TEST_LEDGER_PG_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")
PG_SCHEMA = "hybridflow_ledger_test"


def postgres_engine(schema: str = PG_SCHEMA):
    """An engine whose tables all live in ``schema`` (dropped and made anew), never next to Airflow's."""
    try:
        admin = create_engine(PG_URL, connect_args={"connect_timeout": 3})
        with admin.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
            conn.execute(text(f"CREATE SCHEMA {schema}"))
        admin.dispose()
    except Exception as exc:  # noqa: BLE001 - any failure to reach the server means: skip
        pytest.skip(f"PostgreSQL at {PG_URL} is not reachable ({type(exc).__name__}); the SQLite run covers the code")
    return create_engine(PG_URL, connect_args={"options": f"-csearch_path={schema}"})


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_engine(request, tmp_path):
    from hybridflow.ledger import upgrade

    engine = create_engine(f"sqlite:///{tmp_path / 'ledger.db'}") if request.param == "sqlite" else postgres_engine()
    upgrade(engine)
    yield engine
    engine.dispose()
