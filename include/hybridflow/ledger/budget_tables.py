"""The budget tables of the ledger: per project and month, whether it is frozen and why
(``budget_state``), and which notification thresholds have gone out (``budget_notification``).

Defined with the ledger's other tables and created by its migrations (0002); hybridflow.budgets reads
and writes them. Their own MetaData because they predate the ORM models and 0002 adopts tables an
earlier version created itself.
"""

from __future__ import annotations

from sqlalchemy import Boolean, Column, DateTime, Float, MetaData, String, Table, Text

budget_metadata = MetaData()

budget_state = Table(
    "budget_state",
    budget_metadata,
    Column("project", String(128), primary_key=True),
    Column("period", String(7), primary_key=True),  # YYYY-MM
    Column("budget_usd", Float, nullable=False),
    Column("spend_usd", Float, nullable=False),
    Column("frozen", Boolean, nullable=False, default=False),
    Column("reason", Text, nullable=True),  # why it is frozen, or what lifted the last freeze
    Column("frozen_at", DateTime(timezone=True), nullable=True),
    Column("lifted_at", DateTime(timezone=True), nullable=True),
    Column("evaluated_at", DateTime(timezone=True), nullable=False),
)

budget_notification = Table(
    "budget_notification",
    budget_metadata,
    Column("project", String(128), primary_key=True),
    Column("period", String(7), primary_key=True),
    Column("threshold", Float, primary_key=True),
    Column("spend_usd", Float, nullable=False),
    Column("budget_usd", Float, nullable=False),
    Column("sent_at", DateTime(timezone=True), nullable=False),
)
