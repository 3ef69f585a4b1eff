"""Throttled sign-in: failures are counted per email and per client address in fixed windows.

Counted in the database, like the gateway's quotas, so every control-plane replica sees one count.
When a subject reaches its limit, sign-in for it is refused (without checking the password) until its
window ends; a successful sign-in clears the email's count.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

from sqlalchemy import case, delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from ..db.models import SignInFailures, utcnow
from .keys import aware

# A client address may fail this many times more than one email: several people can share it (NAT).
ADDRESS_FACTOR = 4


@dataclass(frozen=True)
class Policy:
    max_failures: int
    window: dt.timedelta


def subjects(email: str, address: str | None, policy: Policy) -> list[tuple[str, int]]:
    """(subject, its failure limit) for one sign-in attempt."""
    found = [(f"email:{email.strip().lower()}"[:400], policy.max_failures)]
    if address:
        found.append((f"address:{address}"[:400], policy.max_failures * ADDRESS_FACTOR))
    return found


def retry_after(
    session: Session, limits: list[tuple[str, int]], policy: Policy, now: dt.datetime | None = None
) -> int | None:
    """Seconds until these subjects may try again, or None when none of them is locked."""
    now = now or utcnow()
    wait = 0.0
    for subject, limit in limits:
        row = session.get(SignInFailures, subject)
        if row is None or row.failures < limit:
            continue
        started = aware(row.window_started_at)
        assert started is not None  # the column is NOT NULL
        ends = started + policy.window
        if ends > now:
            wait = max(wait, (ends - now).total_seconds())
    return math.ceil(wait) if wait > 0 else None


def record_failure(
    session: Session, limits: list[tuple[str, int]], policy: Policy, now: dt.datetime | None = None
) -> None:
    """Count one failure against each subject, starting a new window where the last one ended."""
    now = now or utcnow()
    # Windows that have ended count for nothing: swept here so the table holds only live ones.
    session.execute(delete(SignInFailures).where(SignInFailures.window_started_at <= now - policy.window))
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    for subject, _limit in limits:
        expired = SignInFailures.window_started_at <= now - policy.window
        # One atomic upsert, so concurrent failures on several replicas all count.
        statement = (
            dialect.insert(SignInFailures)
            .values(subject=subject, window_started_at=now, failures=1)
            .on_conflict_do_update(
                index_elements=[SignInFailures.subject],
                set_={
                    "failures": case((expired, 1), else_=SignInFailures.failures + 1),
                    "window_started_at": case((expired, now), else_=SignInFailures.window_started_at),
                },
            )
        )
        session.execute(statement)
    session.commit()


def clear(session: Session, email: str) -> None:
    row = session.scalar(select(SignInFailures).where(SignInFailures.subject == f"email:{email}"[:400]))
    if row is not None:
        session.delete(row)
        session.commit()
