"""`loraplex control-plane`: migrate the database and serve the control plane (wired into cli/main.py)."""

from __future__ import annotations

import argparse
import logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    parser.add_argument(
        "--no-migrate", action="store_true", help="do not upgrade the database to the latest schema first"
    )
    parser.add_argument(
        "--migrate-only", action="store_true", help="upgrade the database to the latest schema and exit"
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app
    from .db.migrate import upgrade
    from .settings import Settings

    logging.basicConfig(level=logging.INFO)
    settings = Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    if not args.no_migrate or args.migrate_only:
        upgrade(settings.database_url)
    if args.migrate_only:
        return 0
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="info")
    return 0
