"""API keys: `lpx_` + 192 random bits, stored only as HMAC-SHA256 under the server's pepper; each with a
scope (services/scopes.py), and rotated with an overlap in which the old key and the new both work."""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import secrets
import uuid
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from ..db.models import ApiKey, KeyScope, Tenant, utcnow
from ..schemas import KeyCreate, KeyCreated, KeyPublic
from .errors import Conflict, Invalid, NotFound
from .scopes import KeyLimits

KEY_PREFIX = "lpx_"
DISPLAY_CHARS = 12  # "lpx_" and 8 characters: enough to recognise a key, far too few to guess it
# last_used_at is refreshed at most this often, so a busy key does not write on every request.
LAST_USED_RESOLUTION = dt.timedelta(seconds=60)


@dataclass(frozen=True)
class Principal:
    """Who a request speaks for: a tenant, through one of its keys (None: a signed-in console user)."""

    tenant_id: uuid.UUID
    tenant_name: str
    key_id: uuid.UUID | None
    fair_share_weight: float = 1.0  # sent to the engine with each request (its fairness counters)
    limits: KeyLimits = field(default_factory=KeyLimits)  # what the key may do; a console user: all
    # Who acts, in words kept on what it makes (an adapter version's uploaded_by): "key lpx_AbCd1234 (ci)".
    actor: str | None = None


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(24)  # 24 bytes = 192 random bits


def hash_key(key: str, pepper: bytes) -> str:
    return hmac.new(pepper, key.encode(), hashlib.sha256).hexdigest()


def aware(moment: dt.datetime | None) -> dt.datetime | None:
    """SQLite hands back naive datetimes; everything here is UTC."""
    if moment is not None and moment.tzinfo is None:
        return moment.replace(tzinfo=dt.UTC)
    return moment


def create_key(
    session: Session,
    tenant_id: uuid.UUID,
    name: str,
    pepper: bytes,
    expires_at: dt.datetime | None = None,
    *,
    scope: KeyScope = KeyScope.ALL,
    adapters: list[str] | None = None,
    base_model: bool | None = None,
) -> KeyCreated:
    """A new key of the tenant, full unless limited (services/scopes.py); its secret is in the answer
    only. A key limited to adapters calls no base model unless `base_model` says so."""
    expires_at = aware(expires_at)
    if expires_at is not None and expires_at <= utcnow():
        raise Invalid(f"expires_at {expires_at.isoformat()} is in the past; give a future time or none")
    if session.get(Tenant, tenant_id) is None:
        raise NotFound(f"no tenant with id {tenant_id}")
    adapters = None if adapters is None else sorted(set(adapters))
    allowed = base_model if base_model is not None else adapters is None
    key, row = _new_key(tenant_id, name, pepper, scope, adapters, allowed, expires_at)
    session.add(row)
    session.commit()
    return KeyCreated(**to_public(row).model_dump(), key=key)


def create_from(session: Session, tenant_id: uuid.UUID, body: KeyCreate, pepper: bytes) -> KeyCreated:
    """create_key with what a `POST .../keys` body asks for."""
    return create_key(
        session,
        tenant_id,
        body.name,
        pepper,
        body.expires_at,
        scope=body.scope,
        adapters=body.adapters,
        base_model=body.base_model,
    )


def _new_key(
    tenant_id: uuid.UUID,
    name: str,
    pepper: bytes,
    scope: KeyScope,
    adapters: list[str] | None,
    base_model: bool,
    expires_at: dt.datetime | None,
) -> tuple[str, ApiKey]:
    key = generate_key()
    row = ApiKey(
        tenant_id=tenant_id,
        name=name,
        key_hash=hash_key(key, pepper),
        prefix=key[:DISPLAY_CHARS],
        expires_at=expires_at,
        scope=scope.value,
        adapters=adapters,
        base_model=base_model,
    )
    return key, row


def rotate_key(
    session: Session, tenant_id: uuid.UUID, key_id: uuid.UUID, overlap: dt.timedelta, pepper: bytes
) -> KeyCreated:
    """A new key with the old one's name, scope and expiry; the old one stays valid for `overlap` more
    (never past its own expiry), so clients can move to the new key without a moment of failures."""
    now = utcnow()
    old = session.scalar(
        select(ApiKey).where(ApiKey.id == key_id, ApiKey.tenant_id == tenant_id).with_for_update()
    )
    if old is None:  # another tenant's key is as absent as a missing one
        raise NotFound(f"no key with id {key_id}")
    old_expiry = aware(old.expires_at)
    if old.revoked_at is not None or (old_expiry is not None and old_expiry <= now):
        session.rollback()
        raise Conflict(f"key {key_id} is revoked or expired; create a new key instead of rotating it")
    scope = KeyScope(old.scope)
    key, row = _new_key(tenant_id, old.name, pepper, scope, old.adapters, old.base_model, old_expiry)
    ends = now + overlap
    old.expires_at = ends if old_expiry is None else min(old_expiry, ends)
    session.add(row)
    session.commit()
    return KeyCreated(**to_public(row).model_dump(), key=key)


def to_public(row: ApiKey) -> KeyPublic:
    return KeyPublic(
        id=row.id,
        name=row.name,
        prefix=row.prefix,
        created_at=aware(row.created_at),  # type: ignore[arg-type]
        expires_at=aware(row.expires_at),
        revoked_at=aware(row.revoked_at),
        last_used_at=aware(row.last_used_at),
        scope=KeyScope(row.scope),
        adapters=None if row.adapters is None else list(row.adapters),
        base_model=row.base_model,
    )


def limits_of(row: ApiKey) -> KeyLimits:
    adapters = None if row.adapters is None else frozenset(str(a) for a in row.adapters)
    return KeyLimits(scope=KeyScope(row.scope), adapters=adapters, base_model=row.base_model)


def list_keys(session: Session, tenant_id: uuid.UUID) -> list[KeyPublic]:
    rows = session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at))
    return [to_public(r) for r in rows]


def revoke_key(session: Session, tenant_id: uuid.UUID, key_id: uuid.UUID) -> None:
    row = session.scalar(select(ApiKey).where(ApiKey.id == key_id, ApiKey.tenant_id == tenant_id))
    if row is None:  # another tenant's key is as absent as a missing one
        raise NotFound(f"no key with id {key_id}")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        session.commit()


def authenticate(session: Session, key: str, pepper: bytes) -> Principal | None:
    """The principal of a live key, or None for a missing, revoked or expired key or a disabled tenant."""
    if not key.startswith(KEY_PREFIX) or len(key) > 256:
        return None
    digest = hash_key(key, pepper)
    found = session.execute(
        select(ApiKey, Tenant).join(Tenant, Tenant.id == ApiKey.tenant_id).where(ApiKey.key_hash == digest)
    ).first()
    if found is None:
        return None
    row, tenant = found
    if not hmac.compare_digest(row.key_hash, digest):
        return None
    now = utcnow()
    expires_at, last_used = aware(row.expires_at), aware(row.last_used_at)
    if row.revoked_at is not None or tenant.disabled or (expires_at is not None and expires_at <= now):
        return None
    if last_used is None or now - last_used > LAST_USED_RESOLUTION:
        row.last_used_at = now
        session.commit()
    return Principal(
        tenant_id=tenant.id,
        tenant_name=tenant.name,
        key_id=row.id,
        fair_share_weight=tenant.fair_share_weight,
        limits=limits_of(row),
        actor=f"key {row.prefix} ({row.name})",
    )
