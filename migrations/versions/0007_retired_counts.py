"""retired groups counted by fate, so that opening a ledger does not count its whole history

Revision ID: 0007_retired_counts
Revises: 0006_carried
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0007_retired_counts"
down_revision = "0006_carried"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ledger_retired_counts",
        sa.Column("fate", sa.String(16), primary_key=True),
        sa.Column("count", sa.Integer, nullable=False),
    )
    op.execute("INSERT INTO ledger_retired_counts (fate, count) SELECT fate, COUNT(*) FROM ledger_retired GROUP BY fate")


def downgrade() -> None:
    op.drop_table("ledger_retired_counts")
