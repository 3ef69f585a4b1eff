"""How many bytes a tenant's next adapter upload may hold, asked before a byte of its body is read."""

from __future__ import annotations

import uuid

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..db.models import Adapter
from .errors import Forbidden
from .tenants import quota_of


def upload_byte_limit(session: Session, tenant_id: uuid.UUID, upload_limit: int) -> int:
    """The byte limit of this tenant's next upload; refuses a tenant with no room for another adapter.

    A cheap early refusal, so an over-quota tenant's body is never read; `adapters.upload_adapter`
    enforces the same quota again, atomically, when it keeps the adapter.
    """
    quota = quota_of(session, tenant_id)
    if quota.max_adapters is not None:
        count = session.scalar(
            select(func.count()).select_from(Adapter).where(Adapter.tenant_id == tenant_id)
        )
        if (count or 0) >= quota.max_adapters:
            raise Forbidden(f"this tenant already has its quota of {quota.max_adapters} adapters; delete one")
    if quota.max_adapter_bytes is not None:
        return min(upload_limit, quota.max_adapter_bytes)
    return upload_limit
