"""API keys: `lpx_` + 192 random bits, stored only as HMAC-SHA256 under the server's pepper."""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import secrets
import uuid
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from ..db.models import ApiKey, Tenant, utcnow
from ..schemas import KeyCreated, KeyPublic
from .errors import Invalid, NotFound

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
    session: Session, tenant_id: uuid.UUID, name: str, pepper: bytes, expires_at: dt.datetime | None = None
) -> KeyCreated:
    expires_at = aware(expires_at)
    if expires_at is not None and expires_at <= utcnow():
        raise Invalid(f"expires_at {expires_at.isoformat()} is in the past; give a future time or none")
    if session.get(Tenant, tenant_id) is None:
        raise NotFound(f"no tenant with id {tenant_id}")
    key = generate_key()
    row = ApiKey(
        tenant_id=tenant_id,
        name=name,
        key_hash=hash_key(key, pepper),
        prefix=key[:DISPLAY_CHARS],
        expires_at=expires_at,
    )
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
    )


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
    )
