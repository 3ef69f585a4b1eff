"""Tenants and their quotas."""

from __future__ import annotations

import uuid

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, selectinload

from ..db.models import Quota, Tenant
from ..schemas import QuotaPublic, QuotaUpdate, TenantPublic, TenantUpdate
from .errors import Conflict, NotFound


def to_public(tenant: Tenant) -> TenantPublic:
    quota = QuotaPublic.model_validate(tenant.quota) if tenant.quota else QuotaPublic()
    return TenantPublic(
        id=tenant.id,
        name=tenant.name,
        disabled=tenant.disabled,
        fair_share_weight=tenant.fair_share_weight,
        created_at=tenant.created_at,
        quota=quota,
    )


def create_tenant(session: Session, name: str, fair_share_weight: float = 1.0) -> TenantPublic:
    tenant = Tenant(name=name, quota=Quota(), fair_share_weight=fair_share_weight)
    session.add(tenant)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise Conflict(f"a tenant named {name!r} already exists; choose another name") from None
    return to_public(tenant)


def load_tenant(session: Session, tenant_id: uuid.UUID) -> Tenant:
    tenant = session.scalar(select(Tenant).where(Tenant.id == tenant_id).options(selectinload(Tenant.quota)))
    if tenant is None:
        raise NotFound(f"no tenant with id {tenant_id}")
    return tenant


def get_tenant(session: Session, tenant_id: uuid.UUID) -> TenantPublic:
    return to_public(load_tenant(session, tenant_id))


def list_tenants(session: Session) -> list[TenantPublic]:
    tenants = session.scalars(select(Tenant).options(selectinload(Tenant.quota)).order_by(Tenant.name))
    return [to_public(t) for t in tenants]


def update_tenant(session: Session, tenant_id: uuid.UUID, update: TenantUpdate) -> TenantPublic:
    tenant = load_tenant(session, tenant_id)
    if update.name is not None:
        tenant.name = update.name
    if update.disabled is not None:
        tenant.disabled = update.disabled
    if update.fair_share_weight is not None:
        tenant.fair_share_weight = update.fair_share_weight
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise Conflict(f"a tenant named {update.name!r} already exists; choose another name") from None
    return to_public(tenant)


def delete_tenant(session: Session, tenant_id: uuid.UUID) -> None:
    """Deletes the tenant with its keys, adapters, quota and usage (the database cascades); its adapters'
    artifact references are given back in the same transaction (the objects go with the next sweep)."""
    from .adapters import release_tenant  # that module needs this one's quota_of

    release_tenant(session, tenant_id)
    result = session.execute(delete(Tenant).where(Tenant.id == tenant_id))
    session.commit()
    if result.rowcount == 0:  # type: ignore[attr-defined]
        raise NotFound(f"no tenant with id {tenant_id}")


def set_quota(session: Session, tenant_id: uuid.UUID, update: QuotaUpdate) -> QuotaPublic:
    tenant = load_tenant(session, tenant_id)
    quota = tenant.quota or Quota(tenant_id=tenant.id)
    for field, value in update.model_dump().items():
        setattr(quota, field, value)
    tenant.quota = quota
    session.commit()
    return QuotaPublic.model_validate(quota)


def quota_of(session: Session, tenant_id: uuid.UUID) -> QuotaPublic:
    quota = session.get(Quota, tenant_id)
    return QuotaPublic.model_validate(quota) if quota else QuotaPublic()
