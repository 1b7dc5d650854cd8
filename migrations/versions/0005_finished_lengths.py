"""finished trajectories' lengths, the coordinator's length predictor's feed

Revision ID: 0005_finished_lengths
Revises: 0004_progress
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0005_finished_lengths"
down_revision = "0004_progress"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ts_finished_lengths",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("traj_id", sa.String(200), nullable=False),
        sa.Column("group_id", sa.String(200), nullable=False),
        sa.Column("prompt_key", sa.String(32), nullable=False),
        sa.Column("length", sa.Integer, nullable=False),
        sa.Column("at", sa.Float, nullable=False),
        sqlite_autoincrement=True,
    )


def downgrade() -> None:
    op.drop_table("ts_finished_lengths")
