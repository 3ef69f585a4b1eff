"""Adapters: validate an upload against its deployment's base model, store it, and list or delete it."""

from __future__ import annotations

import logging
import tempfile
import uuid
from pathlib import Path

from sqlalchemy import Select, delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, selectinload

from loraplex.adapters import AdapterError, LocalArtifactStore, inspect_adapter

from ..db.models import Adapter, AdapterStatus
from ..schemas import AdapterPublic
from . import deployments
from .errors import Conflict, Forbidden, Invalid, NotFound, TooLarge
from .tenants import quota_of
from .uploads import UploadedFile, unpack

log = logging.getLogger("loraplex.web.adapters")


def to_public(adapter: Adapter) -> AdapterPublic:
    return AdapterPublic(
        id=adapter.id,
        name=adapter.name,
        deployment=adapter.deployment.name,
        base_model=adapter.deployment.base_model,
        status=adapter.status.value,
        error=adapter.error,
        rank=adapter.rank,
        target_modules=list(adapter.target_modules),
        bytes=adapter.bytes,
        sha256=adapter.sha256,
        created_at=adapter.created_at,
    )


def upload_adapter(
    session: Session,
    store: LocalArtifactStore,
    tenant_id: uuid.UUID,
    name: str,
    deployment_name: str,
    files: list[UploadedFile],
    upload_limit: int,
) -> AdapterPublic:
    """Validate and store an adapter; on any refusal nothing is kept (no row, no artifact)."""
    deployment = deployments.by_name(session, deployment_name)
    quota = quota_of(session, tenant_id)
    if quota.max_adapters is not None:
        count = session.scalar(
            select(func.count()).select_from(Adapter).where(Adapter.tenant_id == tenant_id)
        )
        if (count or 0) >= quota.max_adapters:
            raise Forbidden(f"this tenant already has its quota of {quota.max_adapters} adapters; delete one")
    limit = upload_limit
    if quota.max_adapter_bytes is not None:
        limit = min(limit, quota.max_adapter_bytes)

    # The row reserves the name while the upload is checked, so two uploads cannot both take it.
    adapter = Adapter(
        tenant_id=tenant_id, deployment_id=deployment.id, name=name, status=AdapterStatus.VALIDATING
    )
    session.add(adapter)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise Conflict(
            f"an adapter named {name!r} already exists; delete it or choose another name"
        ) from None
    try:
        with tempfile.TemporaryDirectory(prefix="lpx-upload-") as work:
            directory = Path(work)
            unpack(files, directory, limit)
            try:
                manifest = inspect_adapter(directory, deployments.shape_of(deployment))
            except AdapterError as exc:
                raise Invalid(f"adapter refused for {deployment.base_model}: {exc}") from None
            if manifest.weights_bytes > limit:
                raise TooLarge(f"the adapter's weights exceed this tenant's {limit}-byte limit")
            uri = store.put(directory, manifest.sha256)
    except BaseException:
        session.execute(delete(Adapter).where(Adapter.id == adapter.id))
        session.commit()
        raise
    adapter.status = AdapterStatus.READY
    adapter.rank = max(manifest.ranks)
    adapter.target_modules = list(manifest.target_modules)
    adapter.bytes = manifest.weights_bytes
    adapter.sha256 = manifest.sha256
    adapter.storage_uri = uri
    session.commit()
    log.info("adapter ready", extra={"tenant": str(tenant_id), "adapter": name, "sha256": manifest.sha256})
    return get_adapter(session, tenant_id, name)


def _query(tenant_id: uuid.UUID) -> Select[Adapter]:
    return select(Adapter).where(Adapter.tenant_id == tenant_id).options(selectinload(Adapter.deployment))


def list_adapters(session: Session, tenant_id: uuid.UUID) -> list[AdapterPublic]:
    return [to_public(a) for a in session.scalars(_query(tenant_id).order_by(Adapter.name))]


def find_adapter(session: Session, tenant_id: uuid.UUID, name: str) -> Adapter | None:
    return session.scalar(_query(tenant_id).where(Adapter.name == name))


def get_adapter(session: Session, tenant_id: uuid.UUID, name: str) -> AdapterPublic:
    adapter = find_adapter(session, tenant_id, name)
    if adapter is None:  # another tenant's adapter is as absent as a missing one
        raise NotFound(f"no adapter named {name!r}")
    return to_public(adapter)


def delete_adapter(session: Session, tenant_id: uuid.UUID, name: str) -> None:
    # The artifact stays: it is shared by content hash and may serve another adapter.
    result = session.execute(delete(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == name))
    session.commit()
    if result.rowcount == 0:  # type: ignore[attr-defined]
        raise NotFound(f"no adapter named {name!r}")
