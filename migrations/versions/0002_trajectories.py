"""trajectory server tables

Revision ID: 0002_trajectories
Revises: 0001_ledger
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0002_trajectories"
down_revision = "0001_ledger"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ts_groups",
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
    )
    op.create_index("ix_ts_groups_state", "ts_groups", ["state"])
    op.create_table(
        "ts_trajectories",
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
    )
    op.create_index("ix_ts_trajectories_group", "ts_trajectories", ["group_id"])
    op.create_table(
        "ts_meta",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("value", sa.Text, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("ts_meta")
    op.drop_index("ix_ts_trajectories_group", "ts_trajectories")
    op.drop_table("ts_trajectories")
    op.drop_index("ix_ts_groups_state", "ts_groups")
    op.drop_table("ts_groups")
