"""Alembic, configured in code: the scripts live in the repository's migrations/ folder."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(url: str) -> Config:
    if not MIGRATIONS.is_dir():
        raise RuntimeError(f"migrations folder {MIGRATIONS} is missing: run from a source checkout")
    config = Config(str(MIGRATIONS / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS))
    # Percent signs in passwords would read as interpolation in Alembic's ConfigParser.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)
