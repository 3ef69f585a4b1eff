from __future__ import annotations

from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from loraplex.web.db.migrate import downgrade, upgrade
from loraplex.web.db.models import Base
from loraplex.web.db.session import make_engine

TABLES = {"tenants", "api_keys", "deployments", "adapters", "quotas", "rate_windows", "usage_records"}


def _check_round_trip(url: str) -> None:
    upgrade(url)
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            assert set(inspect(connection).get_table_names()) >= TABLES
            # The migration builds exactly what the models describe.
            assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
        downgrade(url)
        with engine.connect() as connection:
            assert set(inspect(connection).get_table_names()) <= {"alembic_version"}
        upgrade(url)  # and again: downgrade left nothing behind (e.g. Postgres enum types)
    finally:
        engine.dispose()


def test_postgres_upgrade_from_empty_and_downgrade_to_base(empty_pg_url: str) -> None:
    _check_round_trip(empty_pg_url)


def test_sqlite_upgrade_from_empty_and_downgrade_to_base(tmp_path: Path) -> None:
    _check_round_trip(f"sqlite:///{tmp_path / 'x.db'}")
