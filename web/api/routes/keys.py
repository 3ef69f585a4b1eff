"""Tenant: the tenant's own API keys."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request, status

from ...schemas import KeyCreate, KeyCreated, KeyPublic
from ...services import keys
from ..deps import CurrentTenant, SessionDep

router = APIRouter(prefix="/api/v1/keys", tags=["keys"])


@router.post("", status_code=status.HTTP_201_CREATED)
def create_key(
    body: KeyCreate, request: Request, session: SessionDep, principal: CurrentTenant
) -> KeyCreated:
    return keys.create_key(session, principal.tenant_id, body.name, request.app.state.pepper, body.expires_at)


@router.get("")
def list_keys(session: SessionDep, principal: CurrentTenant) -> list[KeyPublic]:
    return keys.list_keys(session, principal.tenant_id)


@router.delete("/{key_id}", status_code=status.HTTP_204_NO_CONTENT)
def revoke_key(key_id: uuid.UUID, session: SessionDep, principal: CurrentTenant) -> None:
    keys.revoke_key(session, principal.tenant_id, key_id)
