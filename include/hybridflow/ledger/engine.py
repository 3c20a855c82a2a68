"""The default ledger database: hybridflow.budgets.enforce.ledger_url, migrated on first use."""

from __future__ import annotations

from functools import lru_cache

from sqlalchemy import Engine


@lru_cache(maxsize=8)
def _migrated(url: str) -> Engine:
    from hybridflow.ledger.migrate import _engine_for, upgrade

    engine = _engine_for(url)
    upgrade(engine)
    return engine


def default_engine() -> Engine:
    """The ledger at HYBRIDFLOW_LEDGER_URL (else SQLite under HYBRIDFLOW_HOME), at the latest schema."""
    from hybridflow.budgets.enforce import ledger_url
    from hybridflow.settings import get_settings

    return _migrated(ledger_url(get_settings().home))
