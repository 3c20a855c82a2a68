"""queue waits

Revision ID: 0003
Revises: 0002

How long each gang waited for admission on each cluster: the history start_by placement estimates from.
"""

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('queue_waits',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_key', sa.String(length=255), nullable=False),
    sa.Column('attempt', sa.String(length=255), nullable=False),
    sa.Column('cluster', sa.String(length=128), nullable=False),
    sa.Column('gpus', sa.Integer(), nullable=False),
    sa.Column('priority', sa.String(length=32), nullable=False),
    sa.Column('queued_at', sa.DateTime(), nullable=False),
    sa.Column('admitted_at', sa.DateTime(), nullable=True),
    sa.Column('wait_s', sa.Float(), nullable=True),
    sa.Column('outcome', sa.String(length=32), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('run_key', 'attempt', 'cluster', name='uq_queue_waits_key')
    )
    with op.batch_alter_table('queue_waits', schema=None) as batch_op:
        batch_op.create_index('ix_queue_waits_cluster_queued_at', ['cluster', 'queued_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('queue_waits', schema=None) as batch_op:
        batch_op.drop_index('ix_queue_waits_cluster_queued_at')

    op.drop_table('queue_waits')
