"""ledger tables

Revision ID: 0001
Revises: (none)
"""

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:

    op.create_table('allocation',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('day', sa.String(length=10), nullable=False),
    sa.Column('project', sa.String(length=128), nullable=False),
    sa.Column('team', sa.String(length=128), nullable=False),
    sa.Column('cluster', sa.String(length=128), nullable=False),
    sa.Column('gpu_model', sa.String(length=128), nullable=False),
    sa.Column('pricing_class', sa.String(length=32), nullable=False),
    sa.Column('gpu_hours', sa.Float(), nullable=False),
    sa.Column('effective_gpu_hours', sa.Float(), nullable=True),
    sa.Column('cost_usd', sa.Float(), nullable=False),
    sa.Column('waste', sa.Boolean(), nullable=False),
    sa.Column('waste_gpu_hours', sa.Float(), nullable=False),
    sa.Column('preempted_gpu_hours', sa.Float(), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('allocation', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_allocation_day'), ['day'], unique=False)
        batch_op.create_index(batch_op.f('ix_allocation_project'), ['project'], unique=False)

    op.create_table('attempt',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_key', sa.String(length=255), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('try_number', sa.Integer(), nullable=True),
    sa.Column('label', sa.String(length=255), nullable=True),
    sa.Column('cluster', sa.String(length=128), nullable=True),
    sa.Column('started_at', sa.DateTime(), nullable=False),
    sa.Column('ended_at', sa.DateTime(), nullable=True),
    sa.Column('gpus', sa.Integer(), nullable=False),
    sa.Column('outcome', sa.String(length=32), nullable=False),
    sa.Column('start_step', sa.Integer(), nullable=True),
    sa.Column('last_step', sa.Integer(), nullable=True),
    sa.Column('steps_lost', sa.Integer(), nullable=True),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('run_key', 'seq', name='uq_attempt_run_seq')
    )
    with op.batch_alter_table('attempt', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_attempt_run_key'), ['run_key'], unique=False)

    op.create_table('gpu_sample',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('ts', sa.DateTime(), nullable=False),
    sa.Column('cluster', sa.String(length=128), nullable=False),
    sa.Column('node', sa.String(length=255), nullable=False),
    sa.Column('gpu_uuid', sa.String(length=128), nullable=False),
    sa.Column('mig_key', sa.String(length=64), nullable=False),
    sa.Column('gpu_index', sa.Integer(), nullable=True),
    sa.Column('gpu_model', sa.String(length=128), nullable=True),
    sa.Column('mig_profile', sa.String(length=64), nullable=True),
    sa.Column('mig_instance', sa.String(length=64), nullable=True),
    sa.Column('namespace', sa.String(length=255), nullable=True),
    sa.Column('pod', sa.String(length=255), nullable=True),
    sa.Column('container', sa.String(length=255), nullable=True),
    sa.Column('util_pct', sa.Float(), nullable=True),
    sa.Column('mem_used_mib', sa.Float(), nullable=True),
    sa.Column('mem_free_mib', sa.Float(), nullable=True),
    sa.Column('power_w', sa.Float(), nullable=True),
    sa.Column('temp_c', sa.Float(), nullable=True),
    sa.Column('energy_mj', sa.Float(), nullable=True),
    sa.Column('xid', sa.Integer(), nullable=True),
    sa.Column('ecc_sbe', sa.Integer(), nullable=True),
    sa.Column('ecc_dbe', sa.Integer(), nullable=True),
    sa.Column('run_key', sa.String(length=255), nullable=True),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('cluster', 'node', 'gpu_uuid', 'mig_key', 'ts', name='uq_gpu_sample_key')
    )
    with op.batch_alter_table('gpu_sample', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_gpu_sample_run_key'), ['run_key'], unique=False)
        batch_op.create_index(batch_op.f('ix_gpu_sample_ts'), ['ts'], unique=False)

    op.create_table('idle_allocation',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('day', sa.String(length=10), nullable=False),
    sa.Column('team', sa.String(length=128), nullable=False),
    sa.Column('cluster', sa.String(length=128), nullable=False),
    sa.Column('gpu_hours', sa.Float(), nullable=False),
    sa.Column('cost_usd', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('idle_allocation', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_idle_allocation_day'), ['day'], unique=False)

    op.create_table('price',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('cluster', sa.String(length=128), nullable=False),
    sa.Column('pricing_class', sa.String(length=32), nullable=False),
    sa.Column('gpu_model', sa.String(length=128), nullable=False),
    sa.Column('usd_per_gpu_hour', sa.Float(), nullable=False),
    sa.Column('valid_from', sa.String(length=10), nullable=False),
    sa.Column('source', sa.String(length=255), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('cluster', 'pricing_class', 'gpu_model', 'valid_from', name='uq_price_version')
    )
    op.create_table('run',
    sa.Column('run_key', sa.String(length=255), nullable=False),
    sa.Column('project', sa.String(length=128), nullable=False),
    sa.Column('team', sa.String(length=128), nullable=True),
    sa.Column('cluster', sa.String(length=128), nullable=True),
    sa.Column('gpu_model', sa.String(length=128), nullable=True),
    sa.Column('pricing_class', sa.String(length=32), nullable=True),
    sa.Column('price_per_gpu_hour', sa.Float(), nullable=True),
    sa.Column('workers', sa.Integer(), nullable=True),
    sa.Column('priority', sa.String(length=32), nullable=True),
    sa.Column('dag_id', sa.String(length=255), nullable=True),
    sa.Column('run_id', sa.String(length=255), nullable=True),
    sa.Column('gpu_hours', sa.Float(), nullable=True),
    sa.Column('steps_trained', sa.Integer(), nullable=True),
    sa.Column('steps_lost', sa.Integer(), nullable=True),
    sa.Column('budget_override', sa.Text(), nullable=True),
    sa.Column('recorded_at', sa.DateTime(), nullable=True),
    sa.PrimaryKeyConstraint('run_key')
    )
    with op.batch_alter_table('run', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_run_project'), ['project'], unique=False)




def downgrade() -> None:

    with op.batch_alter_table('run', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_run_project'))

    op.drop_table('run')
    op.drop_table('price')
    with op.batch_alter_table('idle_allocation', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_idle_allocation_day'))

    op.drop_table('idle_allocation')
    with op.batch_alter_table('gpu_sample', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_gpu_sample_ts'))
        batch_op.drop_index(batch_op.f('ix_gpu_sample_run_key'))

    op.drop_table('gpu_sample')
    with op.batch_alter_table('attempt', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_attempt_run_key'))

    op.drop_table('attempt')
    with op.batch_alter_table('allocation', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_allocation_project'))
        batch_op.drop_index(batch_op.f('ix_allocation_day'))

    op.drop_table('allocation')

