"""Where the ledger lives, and its engine at the latest schema.

``HYBRIDFLOW_LEDGER_URL`` (a SQLAlchemy URL without secrets, e.g. for tests), else the Airflow
Connection ``hybridflow_ledger`` (PostgreSQL in production: the password stays in the Connection),
else a SQLite file under ``HYBRIDFLOW_HOME``.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from sqlalchemy import Engine
from sqlalchemy.engine import URL

from hybridflow.errors import ConfigError

LEDGER_URL_ENV = "HYBRIDFLOW_LEDGER_URL"
LEDGER_CONN_ID = "hybridflow_ledger"
_DRIVERS = {"postgres": "postgresql+psycopg2", "postgresql": "postgresql+psycopg2", "sqlite": "sqlite"}


def connection_url(conn) -> URL:
    """A SQLAlchemy URL for an Airflow Connection of type postgres or sqlite; its extra becomes URL
    query parameters (e.g. ``{"options": "-csearch_path=hybridflow"}`` keeps the ledger's tables in
    their own schema when it shares Airflow's database)."""
    driver = _DRIVERS.get((conn.conn_type or "").lower())
    if driver is None:
        raise ConfigError(f"connection {conn.conn_id!r} has type {conn.conn_type!r}; the ledger needs a "
                          "'postgres' (or 'sqlite') Connection, e.g. AIRFLOW_CONN_HYBRIDFLOW_LEDGER="
                          "postgres://user:password@host:5432/db")
    if driver == "sqlite":
        return URL.create("sqlite", database=conn.host or conn.schema)
    extra = {k: str(v) for k, v in (conn.extra_dejson or {}).items()}
    return URL.create(driver, username=conn.login or None, password=conn.password or None, host=conn.host or None,
                      port=conn.port or None, database=conn.schema or None, query=extra)


def _ledger_connection():
    try:
        from airflow.sdk import BaseHook
        from airflow.sdk.exceptions import AirflowNotFoundException
    except ImportError:  # the library without Airflow: env or SQLite only
        return None
    try:
        return BaseHook.get_connection(LEDGER_CONN_ID)
    except AirflowNotFoundException:
        return None


def ledger_url(home: Path) -> str | URL:
    """The ledger database (see the module doc); a URL object keeps a Connection's password out of strings."""
    if env := os.environ.get(LEDGER_URL_ENV):
        return env
    if (conn := _ledger_connection()) is not None:
        return connection_url(conn)
    return f"sqlite:///{Path(home) / 'ledger' / 'ledger.db'}"


@lru_cache(maxsize=8)
def _migrated(url: str | URL) -> Engine:
    from hybridflow.ledger.migrate import _engine_for, upgrade

    engine = _engine_for(url)
    upgrade(engine)
    return engine


def default_engine() -> Engine:
    """The ledger's engine (see the module doc), migrated to the latest schema once per process."""
    from hybridflow.settings import get_settings

    return _migrated(ledger_url(get_settings().home))


def existing_engine() -> Engine | None:
    """The ledger's engine for a read, or None when the ledger is the default SQLite file and it does
    not exist yet (nothing was ever recorded: a read need not create it)."""
    from hybridflow.settings import get_settings

    url = ledger_url(get_settings().home)
    if isinstance(url, str) and url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        return None
    return _migrated(url)
