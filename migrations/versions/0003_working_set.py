"""archive tables for finished trajectory groups; counts of compacted ledger events

Revision ID: 0003_working_set
Revises: 0002_trajectories
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0003_working_set"
down_revision = "0002_trajectories"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ts_groups_archive",
        sa.Column("group_id", sa.String(200), primary_key=True),
        sa.Column("prompt_index", sa.Integer, nullable=False),
        sa.Column("prompt_text", sa.Text, nullable=False),
        sa.Column("answer", sa.Text, nullable=False),
        sa.Column("prompt_ids", sa.LargeBinary, nullable=False),
        sa.Column("members", sa.Integer, nullable=False),
        sa.Column("needed", sa.Integer, nullable=False),
        sa.Column("v_traj", sa.Integer, nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("archived_at", sa.Float, nullable=False),
    )
    op.create_table(
        "ts_trajectories_archive",
        sa.Column("traj_id", sa.String(200), primary_key=True),
        sa.Column("group_id", sa.String(200), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("instance_id", sa.String(200), nullable=True),
        sa.Column("tokens", sa.LargeBinary, nullable=False),
        sa.Column("logprobs", sa.LargeBinary, nullable=False),
        sa.Column("segments", sa.Text, nullable=False),
        sa.Column("finish_reason", sa.String(16), nullable=True),
        sa.Column("reward", sa.Float, nullable=True),
        sa.Column("reward_reason", sa.Text, nullable=True),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("archived_at", sa.Float, nullable=False),
    )
    op.create_index("ix_ts_trajectories_archive_group", "ts_trajectories_archive", ["group_id"])
    op.create_table(
        "ledger_event_counts",
        sa.Column("op", sa.String(32), primary_key=True),
        sa.Column("count", sa.Integer, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("ledger_event_counts")
    op.drop_index("ix_ts_trajectories_archive_group", "ts_trajectories_archive")
    op.drop_table("ts_trajectories_archive")
    op.drop_table("ts_groups_archive")
