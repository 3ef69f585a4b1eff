"""Admin: tenants, their quotas and keys."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request, status

from ...schemas import (
    AdapterPin,
    AdapterPublic,
    KeyCreate,
    KeyCreated,
    QuotaPublic,
    QuotaUpdate,
    TenantCreate,
    TenantPublic,
    TenantUpdate,
)
from ...services import engine_sync, keys, pins, tenants
from ..deps import AdminDep, SessionDep

router = APIRouter(prefix="/admin/v1/tenants", tags=["admin"])


@router.post("", status_code=status.HTTP_201_CREATED)
def create_tenant(body: TenantCreate, session: SessionDep, _: AdminDep) -> TenantPublic:
    return tenants.create_tenant(session, body.name, body.fair_share_weight)


@router.get("")
def list_tenants(session: SessionDep, _: AdminDep) -> list[TenantPublic]:
    return tenants.list_tenants(session)


@router.get("/{tenant_id}")
def get_tenant(tenant_id: uuid.UUID, session: SessionDep, _: AdminDep) -> TenantPublic:
    return tenants.get_tenant(session, tenant_id)


@router.patch("/{tenant_id}")
def update_tenant(tenant_id: uuid.UUID, body: TenantUpdate, session: SessionDep, _: AdminDep) -> TenantPublic:
    return tenants.update_tenant(session, tenant_id, body)


@router.delete("/{tenant_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_tenant(tenant_id: uuid.UUID, request: Request, session: SessionDep, _: AdminDep) -> None:
    tenants.delete_tenant(session, tenant_id)
    engine_sync.wake(request.app)  # its adapters went with it: engines forget them soon


@router.put("/{tenant_id}/quota")
def set_quota(tenant_id: uuid.UUID, body: QuotaUpdate, session: SessionDep, _: AdminDep) -> QuotaPublic:
    return tenants.set_quota(session, tenant_id, body)


@router.post("/{tenant_id}/adapters/{name}/pin")
async def pin_adapter(
    tenant_id: uuid.UUID, name: str, body: AdapterPin, request: Request, _: AdminDep
) -> AdapterPublic:
    """Pin a tenant's adapter version (default: the active one) on its engines, past its quota if need be."""
    return await pins.pin(request.app, tenant_id, name, body.version, enforce_quota=False)


@router.delete("/{tenant_id}/adapters/{name}/pin")
async def unpin_adapter(
    tenant_id: uuid.UUID, name: str, request: Request, _: AdminDep, version: int | None = None
) -> AdapterPublic:
    return await pins.unpin(request.app, tenant_id, name, version)


@router.post("/{tenant_id}/keys", status_code=status.HTTP_201_CREATED)
def create_key(
    tenant_id: uuid.UUID, body: KeyCreate, request: Request, session: SessionDep, _: AdminDep
) -> KeyCreated:
    return keys.create_from(session, tenant_id, body, request.app.state.pepper)
