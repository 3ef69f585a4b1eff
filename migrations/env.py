"""Alembic environment: runs migrations online against sqlalchemy.url (or LORAPLEX_DATABASE_URL)."""

from __future__ import annotations

from alembic import context

from loraplex.web.db.models import Base
from loraplex.web.db.session import make_engine

config = context.config


def database_url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from loraplex.web.settings import Settings

    return Settings().database_url


def run_migrations_online() -> None:
    engine = make_engine(database_url())
    try:
        with engine.connect() as connection:
            context.configure(
                connection=connection,
                target_metadata=Base.metadata,
                render_as_batch=connection.dialect.name == "sqlite",
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


run_migrations_online()
