"""quotas.max_in_flight: a tenant's own cap on requests in flight through one gateway replica

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Existing rows stay null: the gateway's default cap (LORAPLEX_TENANT_MAX_IN_FLIGHT) applies to them.
    op.add_column("quotas", sa.Column("max_in_flight", sa.Integer(), nullable=True))


def downgrade() -> None:
    # SQLite drops a column only by copying the table: batch mode does that.
    with op.batch_alter_table("quotas") as batch:
        batch.drop_column("max_in_flight")
