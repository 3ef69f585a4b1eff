"""Throttled sign-in: attempts are counted per email and per client address in fixed windows.

Counted in the database, like the gateway's quotas, so every control-plane replica sees one count.
An attempt is counted *before* its password is checked, by one conditional upsert per subject that adds
it only while the subject is under its limit: twenty parallel guesses cannot all pass a check that
happens before any of them is counted. A sign-in that succeeds gives its attempt back (and clears the
email's count); one that fails keeps it. A subject at its limit is refused without checking the password
until its window ends.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

from sqlalchemy import case, delete, or_, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from ..db.models import SignInFailures, utcnow
from .client_address import throttle_key
from .keys import aware

# A client address may fail this many times more than one email: several people can share it (NAT).
ADDRESS_FACTOR = 4
MAX_SUBJECT_CHARS = 400


@dataclass(frozen=True)
class Policy:
    max_failures: int
    window: dt.timedelta


def subjects(email: str, address: str | None, policy: Policy) -> list[tuple[str, int]]:
    """(subject, its limit) for one sign-in attempt, always in this order (email, then address), so two
    attempts never lock the same rows in opposite orders."""
    found = [(f"email:{email.strip().lower()}"[:MAX_SUBJECT_CHARS], policy.max_failures)]
    if address:
        found.append(
            (f"address:{throttle_key(address)}"[:MAX_SUBJECT_CHARS], policy.max_failures * ADDRESS_FACTOR)
        )
    return found


def reserve(
    session: Session, limits: list[tuple[str, int]], policy: Policy, now: dt.datetime | None = None
) -> int | None:
    """Count one attempt against every subject, atomically: None when counted (go on and check the
    password), else the seconds until the locked subject may try again (and nothing is counted)."""
    now = now or utcnow()
    expired_before = now - policy.window
    # Windows that have ended count for nothing: swept here so the table holds only live ones.
    session.execute(delete(SignInFailures).where(SignInFailures.window_started_at <= expired_before))
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    for subject, limit in limits:
        expired = SignInFailures.window_started_at <= expired_before
        statement = (
            dialect.insert(SignInFailures)
            .values(subject=subject, window_started_at=now, failures=1)
            .on_conflict_do_update(
                index_elements=[SignInFailures.subject],
                set_={
                    "failures": case((expired, 1), else_=SignInFailures.failures + 1),
                    "window_started_at": case((expired, now), else_=SignInFailures.window_started_at),
                },
                where=or_(expired, SignInFailures.failures < limit),
            )
            .returning(SignInFailures.subject)
        )
        if session.execute(statement).first() is None:
            session.rollback()  # the other subjects' counts of this attempt go too
            return _wait(session, subject, policy, now)
    session.commit()
    return None


def _wait(session: Session, subject: str, policy: Policy, now: dt.datetime) -> int:
    row = session.get(SignInFailures, subject)
    started = aware(row.window_started_at) if row is not None else None
    if started is None:  # its window ended in the meantime
        return 1
    return max(1, math.ceil((started + policy.window - now).total_seconds()))


def succeeded(session: Session, limits: list[tuple[str, int]]) -> None:
    """The password was right: the email's count is cleared, the address gets its attempt back."""
    email, *others = limits
    session.execute(delete(SignInFailures).where(SignInFailures.subject == email[0]))
    for subject, _limit in others:
        session.execute(
            update(SignInFailures)
            .where(SignInFailures.subject == subject, SignInFailures.failures > 0)
            .values(failures=SignInFailures.failures - 1)
        )
    session.commit()
