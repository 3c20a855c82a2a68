"""Alembic environment of the ledger: run through hybridflow.ledger.upgrade with a connection."""

from alembic import context

from hybridflow.ledger.budget_tables import budget_metadata
from hybridflow.ledger.models import Base

# Its own version table, so the ledger can share a database with Airflow's metadata.
VERSION_TABLE = "hybridflow_ledger_version"

connection = context.config.attributes["connection"]
# The budget tables are the ledger's too (0002): autogenerate must see them, not propose dropping them.
context.configure(connection=connection, target_metadata=[Base.metadata, budget_metadata],
                  version_table=VERSION_TABLE, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
