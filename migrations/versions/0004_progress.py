"""progress checkpoints of running trajectories

Revision ID: 0004_progress
Revises: 0003_working_set
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0004_progress"
down_revision = "0003_working_set"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ts_progress",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("traj_id", sa.String(200), nullable=False),
        sa.Column("instance_id", sa.String(200), nullable=False),
        sa.Column("start", sa.Integer, nullable=False),
        sa.Column("tokens", sa.LargeBinary, nullable=False),
        sa.Column("logprobs", sa.LargeBinary, nullable=False),
        sa.Column("segments", sa.Text, nullable=False),
        sa.Column("at", sa.Float, nullable=False),
    )
    op.create_index("ix_ts_progress_traj", "ts_progress", ["traj_id"])


def downgrade() -> None:
    op.drop_index("ix_ts_progress_traj", "ts_progress")
    op.drop_table("ts_progress")
