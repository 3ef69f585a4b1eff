"""How many bytes a tenant's next adapter upload may hold, asked before a byte of its body is read."""

from __future__ import annotations

import uuid

from sqlalchemy.orm import Session

from .adapters import failed_holdings, storage_usage
from .errors import Forbidden
from .tenants import quota_of


def upload_byte_limit(session: Session, tenant_id: uuid.UUID, upload_limit: int) -> int:
    """The byte limit of this tenant's next upload: the platform's, the tenant's per-adapter limit and
    what is left of its storage quota, whichever is least. Refuses a tenant with no room left.

    A cheap early refusal, so an over-quota tenant's body is never read; `adapters.upload_version`
    enforces the same quotas again, atomically, when it keeps the adapter. The name is in the body, not
    read yet: the upload may be a new version of one of the tenant's adapters (max_adapters counts names,
    so only a tenant with none can be refused for it here), and it may replace failed versions, so what
    they hold counts as room.
    """
    quota = quota_of(session, tenant_id)
    usage = storage_usage(session, tenant_id)
    failed_bytes = failed_holdings(session, tenant_id)
    if usage.max_adapters is not None and usage.adapters == 0 and usage.max_adapters == 0:
        raise Forbidden(
            f"this tenant already has its quota of {usage.max_adapters} adapters (max_adapters); "
            "delete one first"
        )
    limit = upload_limit
    if quota.max_adapter_bytes is not None:
        limit = min(limit, quota.max_adapter_bytes)
    if usage.max_storage_bytes is not None:
        left = usage.max_storage_bytes - usage.bytes + failed_bytes
        if left <= 0:
            raise Forbidden(
                "this tenant's adapters fill its storage quota (max_storage_bytes "
                f"{usage.max_storage_bytes}; {usage.bytes} bytes in use); delete an adapter first"
            )
        limit = min(limit, left)
    return limit
