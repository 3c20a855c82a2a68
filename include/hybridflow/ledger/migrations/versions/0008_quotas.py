"""storage and transfer quotas

Revision ID: 0008
Revises: 0007

The bytes each project moved per day (transfer), its bytes held and moved as counted each night with
its quotas and their cost (quota_usage), and the quota notifications sent (quota_notification).
"""

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('transfer',
    sa.Column('key', sa.String(length=512), nullable=False),
    sa.Column('day', sa.String(length=10), nullable=False),
    sa.Column('project', sa.String(length=128), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('cluster', sa.String(length=128), nullable=False),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('run_key', sa.String(length=255), nullable=True),
    sa.Column('dataset', sa.String(length=255), nullable=True),
    sa.Column('version', sa.String(length=255), nullable=True),
    sa.Column('recorded_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('key')
    )
    with op.batch_alter_table('transfer', schema=None) as batch_op:
        batch_op.create_index('ix_transfer_day', ['day'], unique=False)
        batch_op.create_index('ix_transfer_project_day', ['project', 'day'], unique=False)
    op.create_table('quota_usage',
    sa.Column('day', sa.String(length=10), nullable=False),
    sa.Column('project', sa.String(length=128), nullable=False),
    sa.Column('storage_bytes', sa.BigInteger(), nullable=False),
    sa.Column('transfer_bytes_day', sa.BigInteger(), nullable=False),
    sa.Column('transfer_bytes_month', sa.BigInteger(), nullable=False),
    sa.Column('storage_quota_gib', sa.Float(), nullable=True),
    sa.Column('transfer_quota_gib', sa.Float(), nullable=True),
    sa.Column('storage_usd', sa.Float(), nullable=False),
    sa.Column('transfer_usd', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('day', 'project')
    )
    op.create_table('quota_notification',
    sa.Column('project', sa.String(length=128), nullable=False),
    sa.Column('period', sa.String(length=7), nullable=False),
    sa.Column('quota', sa.String(length=32), nullable=False),
    sa.Column('threshold', sa.Float(), nullable=False),
    sa.Column('usage_bytes', sa.BigInteger(), nullable=False),
    sa.Column('quota_gib', sa.Float(), nullable=False),
    sa.Column('sent_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('project', 'period', 'quota', 'threshold')
    )


def downgrade() -> None:
    op.drop_table('quota_notification')
    op.drop_table('quota_usage')
    with op.batch_alter_table('transfer', schema=None) as batch_op:
        batch_op.drop_index('ix_transfer_project_day')
        batch_op.drop_index('ix_transfer_day')
    op.drop_table('transfer')
