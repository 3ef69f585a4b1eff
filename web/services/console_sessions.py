"""Console sign-in sessions, kept in the database so signing out (or disabling a user) ends them at once.

The browser holds a random 256-bit token (in a signed cookie); the table holds only its sha256, so a
copy of the database signs nobody in.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
import uuid

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, selectinload

from ..db.models import ConsoleSession, User, utcnow
from .keys import aware
from .users import UserView, to_view


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def start(session: Session, user_id: uuid.UUID, lifetime: dt.timedelta) -> str:
    """A new session's token (for the cookie). Expired sessions (anyone's) are swept now."""
    now = utcnow()
    session.execute(delete(ConsoleSession).where(ConsoleSession.expires_at <= now))
    token = secrets.token_urlsafe(32)
    session.add(ConsoleSession(id=_digest(token), user_id=user_id, created_at=now, expires_at=now + lifetime))
    session.commit()
    return token


def user_of(session: Session, token: str) -> UserView | None:
    """The signed-in user of a live session, or None (unknown, expired, user or tenant disabled)."""
    found = session.execute(
        select(ConsoleSession, User)
        .join(User, User.id == ConsoleSession.user_id)
        .where(ConsoleSession.id == _digest(token))
        .options(selectinload(User.tenant))
    ).first()
    if found is None:
        return None
    row, user = found
    if aware(row.expires_at) <= utcnow():  # type: ignore[operator]
        return None
    view = to_view(user)
    return view if view.can_sign_in else None


def end(session: Session, token: str) -> None:
    session.execute(delete(ConsoleSession).where(ConsoleSession.id == _digest(token)))
    session.commit()


def end_all(session: Session, user_id: uuid.UUID) -> None:
    """Signs the user out everywhere (after a password change or when disabled)."""
    session.execute(delete(ConsoleSession).where(ConsoleSession.user_id == user_id))
    session.commit()
