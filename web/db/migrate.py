"""Alembic, configured in code: the scripts ship inside the package as `loraplex.migrations`."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from alembic import command
from alembic.config import Config


def migrations_dir() -> Path:
    """The installed migrations folder (the repository's migrations/ in an editable install)."""
    folder = Path(str(resources.files("loraplex.migrations")))
    if not (folder / "env.py").is_file():
        raise RuntimeError(f"migrations folder {folder} has no env.py: the loraplex install is incomplete")
    return folder


def alembic_config(url: str) -> Config:
    folder = migrations_dir()
    config = Config(str(folder / "alembic.ini"))
    config.set_main_option("script_location", str(folder))
    # Percent signs in passwords would read as interpolation in Alembic's ConfigParser.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)
