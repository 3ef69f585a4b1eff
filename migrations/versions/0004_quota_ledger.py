"""quota settlement and sign-in throttling enforced atomically in the database

The quota ledger and the sign-in reservations live in the existing rate_windows and sign_in_failures
rows (each change is one conditional upsert); what they need from the schema is an index for the sweep
of ended sign-in windows that every attempt runs.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        op.f("ix_sign_in_failures_window_started_at"), "sign_in_failures", ["window_started_at"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_sign_in_failures_window_started_at"), table_name="sign_in_failures")
