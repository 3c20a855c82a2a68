"""dr drills

Revision ID: 0006
Revises: 0005

Each disaster-recovery drill's figures, targets and verdict (dr_drill), its whole report kept beside them.
"""

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('dr_drill',
    sa.Column('drill', sa.String(length=255), nullable=False),
    sa.Column('declared_at', sa.DateTime(), nullable=True),
    sa.Column('primary_cluster', sa.String(length=128), nullable=True),
    sa.Column('dr_cluster', sa.String(length=128), nullable=True),
    sa.Column('run_key', sa.String(length=255), nullable=True),
    sa.Column('endpoint', sa.String(length=128), nullable=True),
    sa.Column('inference_rto_s', sa.Float(), nullable=True),
    sa.Column('training_rto_s', sa.Float(), nullable=True),
    sa.Column('rpo_steps_lost', sa.Integer(), nullable=True),
    sa.Column('rpo_dataset_age_s', sa.Float(), nullable=True),
    sa.Column('target_inference_rto_s', sa.Float(), nullable=False),
    sa.Column('target_training_rto_s', sa.Float(), nullable=False),
    sa.Column('target_rpo_steps', sa.Integer(), nullable=True),
    sa.Column('target_dataset_age_s', sa.Float(), nullable=True),
    sa.Column('verdict', sa.String(length=16), nullable=False),
    sa.Column('missed', sa.Text(), nullable=True),
    sa.Column('report', sa.Text(), nullable=False),
    sa.Column('recorded_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('drill')
    )
    with op.batch_alter_table('dr_drill', schema=None) as batch_op:
        batch_op.create_index('ix_dr_drill_declared_at', ['declared_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('dr_drill', schema=None) as batch_op:
        batch_op.drop_index('ix_dr_drill_declared_at')

    op.drop_table('dr_drill')
