"""content-addressed adapter artifacts, reference counts and per-tenant storage

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# Rows from before 0003 carry the hash of their weights only; engines now verify the whole adapter's
# digest (config and weights), so those adapters can no longer be served and must be uploaded again.
REUPLOAD = "uploaded before whole-adapter digests (migration 0003): delete it and upload it again"


def upgrade() -> None:
    op.add_column("quotas", sa.Column("max_storage_bytes", sa.BigInteger(), nullable=True))
    op.create_table(
        "storage_usage",
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("adapters", sa.Integer(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_storage_usage_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_storage_usage")),
    )
    op.create_table(
        "artifacts",
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("refcount", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("digest", name=op.f("pk_artifacts")),
    )
    # The counters start from what exists, so quotas hold for adapters uploaded before this revision.
    op.execute(
        "INSERT INTO storage_usage (tenant_id, adapters, bytes) "
        "SELECT tenant_id, COUNT(*), COALESCE(SUM(bytes), 0) FROM adapters GROUP BY tenant_id"
    )
    # Their stored objects become reference-counted artifacts, deleted with the last adapter using them.
    op.execute(
        "INSERT INTO artifacts (digest, uri, bytes, refcount, created_at) "
        "SELECT sha256, MIN(storage_uri), MAX(bytes), COUNT(*), MIN(created_at) FROM adapters "
        "WHERE sha256 IS NOT NULL AND storage_uri IS NOT NULL GROUP BY sha256"
    )
    adapters = sa.table(
        "adapters", sa.column("sha256", sa.String()), sa.column("status", sa.String()), sa.column("error")
    )
    op.execute(
        adapters.update()
        .where(adapters.c.sha256.is_not(None))
        .values(status=sa.literal_column("'failed'"), error=REUPLOAD)
    )


def downgrade() -> None:
    op.drop_table("artifacts")
    op.drop_table("storage_usage")
    with op.batch_alter_table("quotas") as batch:
        batch.drop_column("max_storage_bytes")
