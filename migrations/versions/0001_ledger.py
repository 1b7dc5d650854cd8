"""staleness ledger tables

Revision ID: 0001_ledger
Revises:
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0001_ledger"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ledger_settings",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("eta", sa.Integer, nullable=False),
        sa.Column("batch_size", sa.Integer, nullable=False),
        sa.Column("batch_redundancy", sa.Float, nullable=False),
        sa.Column("group_size", sa.Integer, nullable=False),
        sa.Column("group_redundancy", sa.Float, nullable=False),
        sa.Column("train_version", sa.Integer, nullable=False),
        sa.Column("sealed", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "ledger_entries",
        sa.Column("group_id", sa.String(200), primary_key=True),
        sa.Column("v_traj", sa.Integer, nullable=False),
        sa.Column("deadline", sa.Integer, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("occupied_seq", sa.Integer, nullable=True),
        sa.Column("completed", sa.Text, nullable=False),
    )
    op.create_table(
        "ledger_retired",
        sa.Column("group_id", sa.String(200), primary_key=True),
        sa.Column("v_traj", sa.Integer, nullable=False),
        sa.Column("fate", sa.String(16), nullable=False),
        sa.Column("buffer", sa.Integer, nullable=False),
        sa.Column("retired_at", sa.Float, nullable=False),
    )
    op.create_table(
        "ledger_events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("op", sa.String(32), nullable=False),
        sa.Column("group_id", sa.String(200), nullable=True),
        sa.Column("buffer", sa.Integer, nullable=True),
        sa.Column("detail", sa.Text, nullable=False),
    )
    op.create_index("ix_ledger_retired_buffer", "ledger_retired", ["buffer"])


def downgrade() -> None:
    op.drop_index("ix_ledger_retired_buffer", "ledger_retired")
    for table in ("ledger_events", "ledger_retired", "ledger_entries", "ledger_settings"):
        op.drop_table(table)
