"""Schema migrations of the ledger, kept in the package (alembic, its own version table)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine

MIGRATIONS = Path(__file__).parent / "migrations"


def _config(connection):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["connection"] = connection
    return cfg


def upgrade(url_or_engine: str | Engine, revision: str = "head") -> None:
    """Bring the ledger at ``url_or_engine`` to ``revision`` (idempotent; creates a SQLite file's folder)."""
    from alembic import command

    engine = url_or_engine if isinstance(url_or_engine, Engine) else _engine_for(url_or_engine)
    with engine.begin() as conn:
        command.upgrade(_config(conn), revision)


def _engine_for(url: str) -> Engine:
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    return create_engine(parsed)
