"""inference cost

Revision ID: 0005
Revises: 0004

What served in each metering window (serving_sample) and the nightly inference cost per project and model
version (inference_allocation).
"""

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('serving_sample',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('window_start', sa.DateTime(), nullable=False),
    sa.Column('window_end', sa.DateTime(), nullable=False),
    sa.Column('cluster', sa.String(length=128), nullable=False),
    sa.Column('endpoint', sa.String(length=128), nullable=False),
    sa.Column('version', sa.String(length=255), nullable=False),
    sa.Column('model', sa.String(length=255), nullable=True),
    sa.Column('unit', sa.String(length=8), nullable=False),
    sa.Column('units', sa.Float(), nullable=False),
    sa.Column('unit_hours', sa.Float(), nullable=False),
    sa.Column('gpu_model', sa.String(length=128), nullable=True),
    sa.Column('pricing_class', sa.String(length=32), nullable=True),
    sa.Column('usd_per_unit_hour', sa.Float(), nullable=False),
    sa.Column('source', sa.String(length=255), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('cluster', 'window_start', 'endpoint', 'version', name='uq_serving_sample_key')
    )
    with op.batch_alter_table('serving_sample', schema=None) as batch_op:
        batch_op.create_index('ix_serving_sample_window_start', ['window_start'], unique=False)
        batch_op.create_index('ix_serving_sample_version', ['version'], unique=False)

    op.create_table('inference_allocation',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('day', sa.String(length=10), nullable=False),
    sa.Column('project', sa.String(length=128), nullable=False),
    sa.Column('team', sa.String(length=128), nullable=False),
    sa.Column('model', sa.String(length=255), nullable=False),
    sa.Column('endpoint', sa.String(length=128), nullable=False),
    sa.Column('version', sa.String(length=255), nullable=False),
    sa.Column('cluster', sa.String(length=128), nullable=False),
    sa.Column('unit', sa.String(length=8), nullable=False),
    sa.Column('unit_hours', sa.Float(), nullable=False),
    sa.Column('usd_per_unit_hour', sa.Float(), nullable=False),
    sa.Column('cost_usd', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('inference_allocation', schema=None) as batch_op:
        batch_op.create_index('ix_inference_allocation_day', ['day'], unique=False)
        batch_op.create_index('ix_inference_allocation_project', ['project'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('inference_allocation', schema=None) as batch_op:
        batch_op.drop_index('ix_inference_allocation_project')
        batch_op.drop_index('ix_inference_allocation_day')

    op.drop_table('inference_allocation')
    with op.batch_alter_table('serving_sample', schema=None) as batch_op:
        batch_op.drop_index('ix_serving_sample_version')
        batch_op.drop_index('ix_serving_sample_window_start')

    op.drop_table('serving_sample')
