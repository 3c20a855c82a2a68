"""budget tables

Revision ID: 0002
Revises: 0001

The budget state (now hybridflow.ledger.budget_tables) used to create these two tables itself, so a ledger made
by an earlier version may be at 0001 and already hold them: a table that exists is left as it is.
"""

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def _missing(name: str) -> bool:
    return not sa.inspect(op.get_bind()).has_table(name)


def upgrade() -> None:
    if _missing('budget_state'):
        op.create_table('budget_state',
        sa.Column('project', sa.String(length=128), nullable=False),
        sa.Column('period', sa.String(length=7), nullable=False),
        sa.Column('budget_usd', sa.Float(), nullable=False),
        sa.Column('spend_usd', sa.Float(), nullable=False),
        sa.Column('frozen', sa.Boolean(), nullable=False),
        sa.Column('reason', sa.Text(), nullable=True),
        sa.Column('frozen_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('lifted_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('evaluated_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('project', 'period')
        )
    if _missing('budget_notification'):
        op.create_table('budget_notification',
        sa.Column('project', sa.String(length=128), nullable=False),
        sa.Column('period', sa.String(length=7), nullable=False),
        sa.Column('threshold', sa.Float(), nullable=False),
        sa.Column('spend_usd', sa.Float(), nullable=False),
        sa.Column('budget_usd', sa.Float(), nullable=False),
        sa.Column('sent_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('project', 'period', 'threshold')
        )


def downgrade() -> None:
    op.drop_table('budget_notification')
    op.drop_table('budget_state')
