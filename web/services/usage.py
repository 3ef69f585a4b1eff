"""Usage records, written once per gateway request, and their summary by day, model and the adapter
version that served it (a name's requests may be split between versions)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ..db.models import UsageRecord, utcnow
from ..schemas import UsageRow, UsageSummary


@dataclass
class Usage:
    tenant_id: uuid.UUID
    api_key_id: uuid.UUID | None
    adapter_id: uuid.UUID | None
    model: str
    endpoint: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engine took from its prefix cache
    exact: bool = True
    latency_ms: int = 0
    status: str = "ok"
    adapter_version: int | None = None  # the version that served it (None: the base model)


def record(session: Session, usage: Usage) -> None:
    now = utcnow()
    session.add(UsageRecord(**vars(usage), created_at=now, day=now.date()))
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        if usage.adapter_id is None:
            raise
        # Its adapter was deleted while the request ran: the usage is still the tenant's, kept under the
        # model name it asked for, as rows written before the delete are (adapter_id SET NULL).
        record(session, dataclasses.replace(usage, adapter_id=None))  # its version number is kept


def summarize(session: Session, tenant_id: uuid.UUID, days: int, by_version: bool = False) -> UsageSummary:
    """The tenant's usage of the last `days` days by UTC day and requested model; `by_version`: each of
    those split by the adapter version that served it (a canary split's versions apart)."""
    since = utcnow().date() - dt.timedelta(days=days - 1)
    keys: list[Any] = [UsageRecord.day, UsageRecord.model]
    if by_version:
        keys.append(UsageRecord.adapter_version)
    found = session.execute(
        select(
            *keys,
            func.count(),
            func.coalesce(func.sum(UsageRecord.prompt_tokens), 0),
            func.coalesce(func.sum(UsageRecord.completion_tokens), 0),
            func.coalesce(func.sum(UsageRecord.cached_tokens), 0),
        )
        .where(UsageRecord.tenant_id == tenant_id, UsageRecord.day >= since)
        .group_by(*keys)
        .order_by(*keys)
    ).all()
    out = []
    for row in found:
        day, model, *version, n, p, c, k = row
        out.append(
            UsageRow(
                day=day,
                model=model,
                version=version[0] if version else None,
                requests=n,
                prompt_tokens=int(p),
                completion_tokens=int(c),
                cached_tokens=int(k),
            )
        )
    return UsageSummary(
        since=since,
        rows=out,
        requests=sum(r.requests for r in out),
        prompt_tokens=sum(r.prompt_tokens for r in out),
        completion_tokens=sum(r.completion_tokens for r in out),
        cached_tokens=sum(r.cached_tokens for r in out),
    )
