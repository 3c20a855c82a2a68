"""reaper releases

Revision ID: 0004
Revises: 0003

The resource reaper's sweeps and what each released (or, in dry-run, listed), with the GPU-hours it stopped.
"""

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('reaper_sweep',
    sa.Column('sweep_key', sa.String(length=255), nullable=False),
    sa.Column('started_at', sa.DateTime(), nullable=False),
    sa.Column('finished_at', sa.DateTime(), nullable=True),
    sa.Column('kept', sa.Integer(), nullable=False),
    sa.Column('errors', sa.Text(), nullable=True),
    sa.Column('recorded_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('sweep_key')
    )
    with op.batch_alter_table('reaper_sweep', schema=None) as batch_op:
        batch_op.create_index('ix_reaper_sweep_started_at', ['started_at'], unique=False)

    op.create_table('reaper_release',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('sweep_key', sa.String(length=255), nullable=False),
    sa.Column('place', sa.String(length=128), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('name', sa.String(length=1024), nullable=False),
    sa.Column('owner_dag_id', sa.String(length=255), nullable=True),
    sa.Column('owner_run_id', sa.String(length=255), nullable=True),
    sa.Column('owner_task_id', sa.String(length=255), nullable=True),
    sa.Column('owner_try', sa.Integer(), nullable=True),
    sa.Column('gpus', sa.Integer(), nullable=False),
    sa.Column('gpu_hours', sa.Float(), nullable=False),
    sa.Column('since', sa.DateTime(), nullable=True),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('dry_run', sa.Boolean(), nullable=False),
    sa.Column('released', sa.Boolean(), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('sweep_key', 'place', 'kind', 'name', name='uq_reaper_release_key')
    )


def downgrade() -> None:
    op.drop_table('reaper_release')
    with op.batch_alter_table('reaper_sweep', schema=None) as batch_op:
        batch_op.drop_index('ix_reaper_sweep_started_at')

    op.drop_table('reaper_sweep')
