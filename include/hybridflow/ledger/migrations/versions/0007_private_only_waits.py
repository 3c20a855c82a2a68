"""private-only queue waits

Revision ID: 0007
Revises: 0006

Whether a gang's wait was for work that may run only on private clusters: placement keeps private
capacity while such work is expected (hybridflow.placement.reserve).
"""

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('queue_waits', schema=None) as batch_op:
        batch_op.add_column(sa.Column('private_only', sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('queue_waits', schema=None) as batch_op:
        batch_op.drop_column('private_only')
