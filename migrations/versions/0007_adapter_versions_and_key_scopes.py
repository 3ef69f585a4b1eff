"""adapter versions (adapter_names, adapters.version, adapters.uploaded_by) and scoped API keys

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# Revoked on downgrade: before 0007 a key cannot be limited, so a limited key would gain full scope.
LIMITED_KEY_REVOKED = "scope != 'all' OR adapters IS NOT NULL OR base_model = false"


@contextmanager
def _keeping_usage_links(column: str) -> Iterator[None]:
    """SQLite alters a table by copying it and dropping the old one, and that drop runs the foreign keys'
    ON DELETE actions: usage_records.<column> (SET NULL) would lose its link. Keep the links aside and
    put them back once the table is rebuilt (the rebuilt table keeps every id)."""
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:
        op.execute(f"CREATE TEMPORARY TABLE kept_links AS SELECT id, {column} FROM usage_records")
    yield
    if sqlite:
        op.execute(
            f"UPDATE usage_records SET {column} = "
            f"(SELECT kept_links.{column} FROM kept_links WHERE kept_links.id = usage_records.id)"
        )
        op.execute("DROP TABLE kept_links")


def upgrade() -> None:
    op.create_table(
        "adapter_names",
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("active_version", sa.Integer(), nullable=True),
        sa.Column("last_version", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_adapter_names_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("tenant_id", "name", name=op.f("pk_adapter_names")),
    )
    with _keeping_usage_links("adapter_id"), op.batch_alter_table("adapters") as batch:
        # Every adapter uploaded so far is version 1 of its name, and the active one.
        batch.add_column(sa.Column("version", sa.Integer(), server_default="1", nullable=False))
        batch.add_column(sa.Column("uploaded_by", sa.String(length=400), nullable=True))
        batch.drop_constraint("uq_adapters_tenant_id_name", type_="unique")
        batch.create_unique_constraint("uq_adapters_tenant_id_name_version", ["tenant_id", "name", "version"])
    op.execute(
        "INSERT INTO adapter_names (tenant_id, name, active_version, last_version) "
        "SELECT tenant_id, name, 1, 1 FROM adapters"
    )
    # Existing keys keep what they could do: everything, every adapter, the base models.
    op.add_column("api_keys", sa.Column("scope", sa.String(length=16), server_default="all", nullable=False))
    op.add_column("api_keys", sa.Column("adapters", sa.JSON(), nullable=True))
    op.add_column("api_keys", sa.Column("base_model", sa.Boolean(), server_default=sa.true(), nullable=False))


def downgrade() -> None:
    # Only the active version of each name survives (one adapter per name, as before 0007); the others
    # give back their bytes and their artifact references (an object left unreferenced is deleted by the
    # control plane's sweep when it next starts).
    inactive = (
        "FROM adapters WHERE NOT EXISTS (SELECT 1 FROM adapter_names n "
        "WHERE n.tenant_id = adapters.tenant_id AND n.name = adapters.name "
        "AND n.active_version = adapters.version)"
    )
    op.execute(
        "UPDATE artifacts SET refcount = refcount - "
        f"(SELECT COUNT(*) {inactive} AND adapters.sha256 = artifacts.digest)"
    )
    op.execute(f"DELETE {inactive}")
    # Before 0007 the counters count adapter rows and their bytes: what is left is exactly that.
    op.execute(
        "UPDATE storage_usage SET "
        "adapters = (SELECT COUNT(*) FROM adapters a WHERE a.tenant_id = storage_usage.tenant_id), "
        "bytes = (SELECT COALESCE(SUM(a.bytes), 0) FROM adapters a "
        "WHERE a.tenant_id = storage_usage.tenant_id)"
    )
    op.execute(
        "UPDATE api_keys SET revoked_at = CURRENT_TIMESTAMP "
        f"WHERE revoked_at IS NULL AND ({LIMITED_KEY_REVOKED})"
    )
    with _keeping_usage_links("api_key_id"), op.batch_alter_table("api_keys") as batch:
        batch.drop_column("base_model")
        batch.drop_column("adapters")
        batch.drop_column("scope")
    with _keeping_usage_links("adapter_id"), op.batch_alter_table("adapters") as batch:
        batch.drop_constraint("uq_adapters_tenant_id_name_version", type_="unique")
        batch.create_unique_constraint("uq_adapters_tenant_id_name", ["tenant_id", "name"])
        batch.drop_column("uploaded_by")
        batch.drop_column("version")
    op.drop_table("adapter_names")
