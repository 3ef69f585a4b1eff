"""Requests and tokens per minute, counted in the database so every gateway replica sees one count.

A request is admitted by one atomic upsert on the tenant's row for the current minute: it adds the
request and a reservation of the most tokens the request can use (its prompt plus the completion limit
the engine will honour), only while both counts stay within their limits, so concurrent requests on any
number of replicas cannot slip past them.

While the request runs, its `Ledger` keeps, per minute, what this request holds in the tenant's rows:
the prompt in the minute it was admitted, the tokens produced in the minute they were produced, and what
it may still produce in the current minute (carried into each new minute as the clock passes one, so a
long stream keeps counting against the minute it is producing in). When the request ends, however it
ends, the remaining allowance is released and exact counts from the engine replace the estimates.
"""

from __future__ import annotations

import math
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, case, delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from ..db.models import RateWindow
from ..schemas import QuotaPublic
from .errors import QuotaExceeded, ServiceError

# Windows this old are deleted now and then (and never written to again): admission only reads the
# current minute; older rows are the record of tokens per minute for this long.
KEEP_MINUTES = 60


class TooLargeForQuota(ServiceError):
    """The request could never be admitted: it alone may use more tokens than a minute allows."""

    status_code = 400


def minute_of(now: float) -> int:
    return int(now // 60)


@dataclass
class Ledger:
    """What one admitted request holds in the tenant's minute rows; pure bookkeeping, no database.

    `charged` is what this request has added to each minute's row so far; `target` is what it should
    have added given what is known now. The difference is written by `apply`, then `commit`ted here.
    """

    tenant_id: uuid.UUID
    counted: bool  # False: the tenant has no rate limits; nothing is written
    first_minute: int
    prompt_tokens: int
    completion_limit: int
    produced: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    charged: dict[int, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def reserved(self) -> int:
        return self.prompt_tokens + self.completion_limit

    def produce(self, tokens: int, now: float) -> None:
        """`tokens` completion tokens came out of the engine at `now`."""
        if tokens:
            self.produced[minute_of(now)] += tokens

    def spread(self, tokens: int, started: float, ended: float) -> None:
        """`tokens` came out at unknown moments between `started` and `ended` (a plain, unstreamed
        answer): charged to each minute in proportion to the time the request spent in it."""
        if tokens <= 0:
            return
        first, last = minute_of(started), minute_of(max(started, ended))
        if first == last:
            self.produced[first] += tokens
            return
        span = ended - started
        shares = {m: (min(ended, (m + 1) * 60) - max(started, m * 60)) / span for m in range(first, last + 1)}
        given = {m: math.floor(tokens * share) for m, share in shares.items()}
        # Largest remainders get the tokens floor() left over, so the parts sum to `tokens` exactly.
        left = tokens - sum(given.values())
        for m in sorted(shares, key=lambda m: tokens * shares[m] - given[m], reverse=True)[:left]:
            given[m] += 1
        for m, n in given.items():
            if n:
                self.produced[m] += n

    def settle_exact(self, prompt_tokens: int, completion_tokens: int, now: float) -> None:
        """The engine's own counts replace the estimates: the prompt's in its minute; a difference in
        completion tokens lands on the latest minutes that produced any (or now)."""
        self.prompt_tokens = max(0, prompt_tokens)
        difference = max(0, completion_tokens) - sum(self.produced.values())
        if difference > 0:
            self.produced[max(self.produced, default=minute_of(now))] += difference
        for m in sorted(self.produced, reverse=True):
            if difference >= 0:
                break
            taken = min(self.produced[m], -difference)
            self.produced[m] -= taken
            difference += taken

    def target(self, now: float, final: bool) -> dict[int, int]:
        wanted: dict[int, int] = defaultdict(int)
        wanted[self.first_minute] += self.prompt_tokens
        for m, n in self.produced.items():
            wanted[m] += n
        if not final:  # what may still come is held in the current minute
            wanted[minute_of(now)] += max(0, self.completion_limit - sum(self.produced.values()))
        return wanted

    def pending(self, now: float, final: bool = False) -> dict[int, int]:
        """Per minute, what to add to the tenant's rows (negative: to give back)."""
        if not self.counted:
            return {}
        wanted = self.target(now, final)
        changes = {m: wanted.get(m, 0) - self.charged.get(m, 0) for m in set(wanted) | set(self.charged)}
        return {m: d for m, d in sorted(changes.items()) if d}

    def commit(self, changes: dict[int, int]) -> None:
        for m, d in changes.items():
            self.charged[m] += d


def _insert(session: Session) -> Any:
    """The dialect's INSERT (both have ON CONFLICT DO UPDATE ... WHERE)."""
    return (postgresql if session.get_bind().dialect.name == "postgresql" else sqlite).insert


def admit(
    session: Session,
    tenant_id: uuid.UUID,
    quota: QuotaPublic,
    prompt_tokens: int,
    completion_limit: int,
    now: float | None = None,
) -> Ledger:
    """Count one request and reserve its most tokens in this minute, or raise `QuotaExceeded`."""
    now = time.time() if now is None else now
    minute = minute_of(now)
    ledger = Ledger(tenant_id, False, minute, prompt_tokens, completion_limit)
    rpm, tpm = quota.requests_per_minute, quota.tokens_per_minute
    if rpm is None and tpm is None:
        return ledger
    retry_after = max(1, math.ceil(60 - now % 60))
    if rpm == 0 or tpm == 0:
        raise QuotaExceeded("this tenant's quota allows no requests; ask an admin to raise it", retry_after)
    reserve = ledger.reserved
    if tpm is not None and reserve > tpm:
        raise TooLargeForQuota(
            f"max_tokens: this request may use {reserve} tokens (about {prompt_tokens} in the prompt, "
            f"{completion_limit} for the completion) but the quota is {tpm} tokens per minute; "
            "lower max_tokens or shorten the prompt"
        )
    conditions = []
    if rpm is not None:
        conditions.append(RateWindow.requests < rpm)
    if tpm is not None:
        conditions.append(RateWindow.tokens + reserve <= tpm)
    # One statement: the row is created, or updated only while the limits hold (Postgres locks the row
    # for the check; SQLite serialises writers), so there is no window between counting and writing.
    statement = (
        _insert(session)(RateWindow)
        .values(tenant_id=tenant_id, minute=minute, requests=1, tokens=reserve)
        .on_conflict_do_update(
            index_elements=[RateWindow.tenant_id, RateWindow.minute],
            set_={"requests": RateWindow.requests + 1, "tokens": RateWindow.tokens + reserve},
            where=and_(*conditions),
        )
        .returning(RateWindow.requests)
    )
    admitted = session.execute(statement).first()
    if minute % 10 == 0:
        session.execute(
            delete(RateWindow).where(
                RateWindow.tenant_id == tenant_id, RateWindow.minute < minute - KEEP_MINUTES
            )
        )
    session.commit()
    if admitted is not None:
        ledger.counted = True
        ledger.commit({minute: reserve})
        return ledger
    window = session.scalar(
        select(RateWindow).where(RateWindow.tenant_id == tenant_id, RateWindow.minute == minute)
    )
    if rpm is not None and window is not None and window.requests >= rpm:
        message = f"rate limit reached: {rpm} requests per minute; retry in {retry_after} s"
    else:
        message = f"rate limit reached: {tpm} tokens per minute; retry in {retry_after} s"
    raise QuotaExceeded(message, retry_after)


def apply(session: Session, tenant_id: uuid.UUID, changes: dict[int, int], now: float | None = None) -> None:
    """Add `changes` (minute -> tokens) to the tenant's rows in one transaction, minutes in order (so
    two requests never lock the same rows in opposite orders). Already admitted, so never refused."""
    now = time.time() if now is None else now
    oldest = minute_of(now) - KEEP_MINUTES
    for minute, delta in sorted(changes.items()):
        if minute < oldest or not delta:
            continue  # deleted or about to be: nothing reads it any more
        added = RateWindow.tokens + delta
        session.execute(
            _insert(session)(RateWindow)
            .values(tenant_id=tenant_id, minute=minute, requests=0, tokens=max(0, delta))
            .on_conflict_do_update(
                index_elements=[RateWindow.tenant_id, RateWindow.minute],
                set_={"tokens": case((added < 0, 0), else_=added)},
            )
        )
    session.commit()


def tokens_by_minute(session: Session, tenant_id: uuid.UUID) -> dict[int, int]:
    """The tenant's counted tokens per minute still on record (tests and the usage pages read it)."""
    rows = session.execute(
        select(RateWindow.minute, RateWindow.tokens)
        .where(RateWindow.tenant_id == tenant_id)
        .order_by(RateWindow.minute)
    )
    return {int(m): int(t) for m, t in rows}
