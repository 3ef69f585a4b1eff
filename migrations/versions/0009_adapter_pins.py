"""adapter pins: adapters.pinned, quotas.max_pinned_adapters

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nothing is pinned; every tenant may pin 2 adapter versions until an admin says otherwise.
    op.add_column("adapters", sa.Column("pinned", sa.Boolean(), server_default=sa.false(), nullable=False))
    op.add_column("quotas", sa.Column("max_pinned_adapters", sa.Integer(), server_default="2", nullable=True))


def downgrade() -> None:
    # Pins are dropped (engines keep theirs until restarted; an older control plane never unpins them).
    with op.batch_alter_table("quotas") as batch:
        batch.drop_column("max_pinned_adapters")
    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("pinned")
