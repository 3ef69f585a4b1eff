"""`loraplex control-plane`: migrate the database and serve the control plane (wired into cli/main.py).

`loraplex control-plane migrate` upgrades the database to the latest schema and exits (the Helm chart's
migration hook runs it once per install or upgrade, so replicas start with --no-migrate and never race).
`loraplex control-plane create-admin --email E --password-stdin` makes the console's first admin.
"""

from __future__ import annotations

import argparse
import getpass
import logging
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    parser.add_argument(
        "--no-migrate", action="store_true", help="do not upgrade the database to the latest schema first"
    )
    parser.add_argument(
        "--migrate-only", action="store_true", help="upgrade the database to the latest schema and exit"
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", help="without one: serve")
    actions.add_parser(
        "migrate",
        help="upgrade the database to the latest schema and exit",
        description="Upgrade the database (LORAPLEX_DATABASE_URL) to the latest schema and exit.",
    )
    admin = actions.add_parser(
        "create-admin",
        help="create a console admin (the first one, or another), after upgrading the database",
        description="Create a platform admin for the web console. The database is upgraded first.",
    )
    admin.add_argument("--email", required=True, help="the admin's email, used to sign in")
    admin.add_argument(
        "--password-stdin",
        action="store_true",
        help="read the password from the first line of standard input (else it is asked for twice)",
    )
    admin.add_argument(
        "--update",
        action="store_true",
        help="if the email already has an account: make it an admin, enable it and set this password",
    )


def run(args: argparse.Namespace) -> int:
    action = getattr(args, "action", None)
    if action == "create-admin":
        return create_admin(args)
    if action == "migrate":
        return migrate()
    return serve(args)


def migrate() -> int:
    from .db.migrate import upgrade
    from .settings import Settings

    logging.basicConfig(level=logging.INFO)
    settings = Settings()
    if settings.database_url.startswith("sqlite"):
        # Only SQLite lives under data_dir; a cluster's hook Job has a read-only root and Postgres.
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database_url)
    return 0


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app
    from .db.migrate import upgrade
    from .settings import Settings

    logging.basicConfig(level=logging.INFO)
    if args.migrate_only:
        return migrate()
    settings = Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    if not args.no_migrate:
        upgrade(settings.database_url)
    # No proxy headers: the client address is decided by LORAPLEX_TRUSTED_PROXIES alone (docs/security.md).
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="info", proxy_headers=False)
    return 0


def read_password(from_stdin: bool) -> str:
    if from_stdin:
        return sys.stdin.readline().rstrip("\r\n")
    first = getpass.getpass("Password: ")
    if getpass.getpass("Password again: ") != first:
        raise ValueError("the two passwords differ")
    return first


def create_admin(args: argparse.Namespace) -> int:
    from .db.migrate import upgrade
    from .db.models import UserRole
    from .db.session import Database
    from .services import console_sessions, users
    from .services.errors import ServiceError
    from .settings import Settings

    settings = Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        password = read_password(args.password_stdin)
        upgrade(settings.database_url)
        db = Database(settings.database_url)
        try:
            with db.session() as session:
                existing = users.find_by_email(session, args.email)
                if existing is not None and args.update:
                    users.set_password(session, existing.id, password)
                    users.make_admin(session, existing.id)
                    console_sessions.end_all(session, existing.id)  # the old password's sessions end
                    print(f"{existing.email} is an admin now, with the new password")
                    return 0
                created = users.create_user(session, args.email, password, UserRole.ADMIN, None)
        finally:
            db.dispose()
    except (ServiceError, ValueError) as exc:
        message = exc.message if isinstance(exc, ServiceError) else str(exc)
        hint = (
            " (add --update to make that account an admin and reset its password)"
            if "exists" in message
            else ""
        )
        print(f"loraplex control-plane create-admin: {message}{hint}", file=sys.stderr)
        return 1
    print(f"admin {created.email} created; sign in at /console/sign-in")
    return 0
