"""canary splits: adapter_names.traffic and sticky, usage_records.adapter_version

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # No split anywhere: every name's requests keep going to its active version.
    op.add_column("adapter_names", sa.Column("traffic", sa.JSON(), nullable=True))
    op.add_column(
        "adapter_names", sa.Column("sticky", sa.Boolean(), server_default=sa.true(), nullable=False)
    )
    # Records from before splits name no version (null), as base-model records do.
    op.add_column("usage_records", sa.Column("adapter_version", sa.Integer(), nullable=True))


def downgrade() -> None:
    # A split is dropped: each name's requests go to its active version again. Neither table is the target
    # of a foreign key, so SQLite's table rebuild loses nothing.
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("adapter_version")
    with op.batch_alter_table("adapter_names") as batch:
        batch.drop_column("sticky")
        batch.drop_column("traffic")
