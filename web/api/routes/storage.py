"""Tenant: what the tenant's adapters take in the artifact store, against its storage quotas."""

from __future__ import annotations

from fastapi import APIRouter

from ...schemas import StorageUsagePublic
from ...services import adapters
from ..deps import Reader, SessionDep

router = APIRouter(prefix="/api/v1/storage", tags=["adapters"])


@router.get("")
def get_storage(session: SessionDep, principal: Reader) -> StorageUsagePublic:
    """The tenant's adapter count and stored bytes, with max_adapters and max_storage_bytes."""
    return adapters.storage_usage(session, principal.tenant_id)
