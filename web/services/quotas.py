"""Requests and tokens per minute, counted in the database so every gateway replica sees one count.

Admission is one atomic upsert on the tenant's row for the current minute: it adds the request and a
token reservation (prompt estimate + max_tokens) only while both counts are under their limits, so
concurrent requests on any number of replicas cannot all slip through. When a request ends, its
reservation is swapped for the tokens it really used.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from sqlalchemy import and_, delete, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from ..db.models import RateWindow
from ..schemas import QuotaPublic
from .errors import QuotaExceeded

# Windows this old are deleted now and then; they only ever matter for the current minute.
KEEP_MINUTES = 60


@dataclass(frozen=True)
class Admission:
    minute: int | None  # None: the tenant has no rate limits, nothing was counted
    reserved: int


def admit(
    session: Session, tenant_id: uuid.UUID, quota: QuotaPublic, reserve: int, now: float | None = None
) -> Admission:
    rpm, tpm = quota.requests_per_minute, quota.tokens_per_minute
    if rpm is None and tpm is None:
        return Admission(minute=None, reserved=0)
    now = time.time() if now is None else now
    minute = int(now // 60)
    retry_after = max(1, math.ceil(60 - now % 60))
    conditions = []
    if rpm is not None:
        conditions.append(RateWindow.requests < rpm)
    if tpm is not None:
        conditions.append(RateWindow.tokens < tpm)
    if rpm == 0 or tpm == 0:
        raise QuotaExceeded("this tenant's quota allows no requests; ask an admin to raise it", retry_after)

    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    statement = (
        dialect.insert(RateWindow)
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
        return Admission(minute=minute, reserved=reserve)
    window = session.scalar(
        select(RateWindow).where(RateWindow.tenant_id == tenant_id, RateWindow.minute == minute)
    )
    if rpm is not None and window is not None and window.requests >= rpm:
        message = f"rate limit reached: {rpm} requests per minute; retry in {retry_after} s"
    else:
        message = f"rate limit reached: {tpm} tokens per minute; retry in {retry_after} s"
    raise QuotaExceeded(message, retry_after)


def settle(session: Session, tenant_id: uuid.UUID, admission: Admission, used_tokens: int) -> None:
    """Swap the admission's reservation for the tokens the request really used."""
    if admission.minute is None or used_tokens == admission.reserved:
        return
    session.execute(
        update(RateWindow)
        .where(RateWindow.tenant_id == tenant_id, RateWindow.minute == admission.minute)
        .values(tokens=RateWindow.tokens + (used_tokens - admission.reserved))
    )
    session.commit()
