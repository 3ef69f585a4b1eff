"""tenants.fair_share_weight (the engine's per-tenant fairness weight) and usage_records.cached_tokens
(prompt tokens served from the engine's prefix cache)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Existing rows take the defaults: every tenant an equal share, no cached tokens recorded.
    op.add_column("tenants", sa.Column("fair_share_weight", sa.Float(), server_default="1", nullable=False))
    op.add_column(
        "usage_records", sa.Column("cached_tokens", sa.Integer(), server_default="0", nullable=False)
    )


def downgrade() -> None:
    # SQLite drops a column only by copying the table: batch mode does that.
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("cached_tokens")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("fair_share_weight")
