"""the response's other fields, carried with a trajectory

Revision ID: 0006_carried
Revises: 0005_finished_lengths
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0006_carried"
down_revision = "0005_finished_lengths"
branch_labels = None
depends_on = None

TABLES = ("ts_trajectories", "ts_trajectories_archive")


def upgrade() -> None:
    for table in TABLES:
        op.add_column(table, sa.Column("carried", sa.Text, nullable=True))


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("carried")
