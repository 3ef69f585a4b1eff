"""Tenant: the tenant's own API keys: make (with a scope), list, rotate, revoke."""

from __future__ import annotations

import datetime as dt
import uuid

from fastapi import APIRouter, Request, status

from ...schemas import KeyCreate, KeyCreated, KeyPublic, KeyRotate
from ...services import keys
from ..deps import KeyManager, Reader, SessionDep

router = APIRouter(prefix="/api/v1/keys", tags=["keys"])


@router.post("", status_code=status.HTTP_201_CREATED)
def create_key(body: KeyCreate, request: Request, session: SessionDep, principal: KeyManager) -> KeyCreated:
    return keys.create_from(session, principal.tenant_id, body, request.app.state.pepper)


@router.get("")
def list_keys(session: SessionDep, principal: Reader) -> list[KeyPublic]:
    return keys.list_keys(session, principal.tenant_id)


@router.post("/{key_id}/rotate", status_code=status.HTTP_201_CREATED)
def rotate_key(
    key_id: uuid.UUID, body: KeyRotate, request: Request, session: SessionDep, principal: KeyManager
) -> KeyCreated:
    """A new key like this one; this one stays valid `overlap_seconds` more, then expires."""
    overlap = dt.timedelta(seconds=body.overlap_seconds)
    return keys.rotate_key(session, principal.tenant_id, key_id, overlap, request.app.state.pepper)


@router.delete("/{key_id}", status_code=status.HTTP_204_NO_CONTENT)
def revoke_key(key_id: uuid.UUID, session: SessionDep, principal: KeyManager) -> None:
    keys.revoke_key(session, principal.tenant_id, key_id)
