"""Adapters: validate an upload against its deployment's base model, store it, and list or delete it.

Storage is content-addressed and reference-counted: an adapter's object in the artifact store is keyed by
its whole-adapter digest (config and weights) and shared by every adapter row with that digest; the
`artifacts` row counts them, and the object is deleted once none is left. Quotas (adapters per tenant,
bytes per tenant) are enforced by single conditional UPDATEs on the tenant's `storage_usage` counters,
never by counting and then inserting, so parallel uploads cannot overshoot them on SQLite or Postgres.

Every transaction that writes takes its rows in one order (adapter, then storage_usage, then artifact),
and on SQLite its first statement is a write, so it holds the database's write lock from its start.
"""

from __future__ import annotations

import logging
import tempfile
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Select, delete, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, selectinload

from loraplex.adapters import (
    AdapterError,
    AdapterManifest,
    ArtifactStore,
    StoreUnavailable,
    inspect_adapter,
)
from loraplex.adapters.digest import ADAPTER_FILES

from ..db.models import Adapter, AdapterStatus, Artifact, StorageUsage
from ..schemas import AdapterPublic, StorageUsagePublic
from . import deployments
from .errors import Conflict, Forbidden, Invalid, NotFound, ServiceError, TooLarge
from .tenants import quota_of
from .uploads import UploadedFile, unpack

log = logging.getLogger("loraplex.web.adapters")

# Unreferenced artifacts deleted per sweep: bounded, so a store that is down never stalls a request long.
SWEEP_BATCH = 16


class StorageUnavailable(ServiceError):
    """The artifact store cannot be reached or refused our credentials: nothing was stored, try later."""

    status_code = 503


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
    store: ArtifactStore,
    tenant_id: uuid.UUID,
    name: str,
    deployment_name: str,
    files: list[UploadedFile],
    upload_limit: int,
) -> AdapterPublic:
    """Validate and store an adapter; on any refusal nothing is kept (no row, no artifact, no quota)."""
    deployment = deployments.by_name(session, deployment_name)
    quota = quota_of(session, tenant_id)
    _check_store(store)  # before anything is written: an upload the store cannot take is refused whole
    limit = upload_limit
    if quota.max_adapter_bytes is not None:
        limit = min(limit, quota.max_adapter_bytes)

    adapter_id = _reserve_adapter(session, tenant_id, deployment.id, name, quota.max_adapters)
    digest: str | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="lpx-upload-") as work:
            directory = Path(work)
            unpack(files, directory, limit)
            try:
                manifest = inspect_adapter(directory, deployments.shape_of(deployment))
            except AdapterError as exc:
                raise Invalid(f"adapter refused for {deployment.base_model}: {exc}") from None
            size = sum((directory / f).stat().st_size for f in ADAPTER_FILES)
            if size > limit:
                raise TooLarge(f"the adapter ({size} bytes) exceeds this tenant's {limit}-byte limit")
            digest = manifest.sha256
            _claim_storage(session, store, adapter_id, tenant_id, manifest, size, quota.max_storage_bytes)
            try:
                uri = store.put(directory, digest)
            except StoreUnavailable as exc:
                raise StorageUnavailable(f"the adapter could not be stored: {exc}") from None
        _mark_ready(session, adapter_id, manifest, uri)
    except BaseException:
        session.rollback()
        _release(session, adapter_id)
        if digest is not None:  # the object may be half written: delete it now if nothing else uses it
            sweep_artifacts(session, store, [digest])
        raise
    log.info("adapter ready", extra={"tenant": str(tenant_id), "adapter": name, "digest": digest})
    return get_adapter(session, tenant_id, name)


def _check_store(store: ArtifactStore) -> None:
    try:
        store.check()
    except StoreUnavailable as exc:
        raise StorageUnavailable(f"uploads are refused for now: {exc}") from None


def _reserve_adapter(
    session: Session, tenant_id: uuid.UUID, deployment_id: uuid.UUID, name: str, max_adapters: int | None
) -> uuid.UUID:
    """Count the adapter against max_adapters and reserve its name, in one transaction."""
    _ensure_usage_row(session, tenant_id)
    taken = update(StorageUsage).where(StorageUsage.tenant_id == tenant_id)
    if max_adapters is not None:
        taken = taken.where(StorageUsage.adapters < max_adapters)
    if _rowcount(session.execute(taken.values(adapters=StorageUsage.adapters + 1))) == 0:
        session.rollback()
        raise Forbidden(
            f"this tenant already has its quota of {max_adapters} adapters (max_adapters); delete one first"
        )
    adapter = Adapter(
        tenant_id=tenant_id, deployment_id=deployment_id, name=name, status=AdapterStatus.VALIDATING
    )
    session.add(adapter)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise Conflict(
            f"an adapter named {name!r} already exists; delete it or choose another name"
        ) from None
    return adapter.id


def _claim_storage(
    session: Session,
    store: ArtifactStore,
    adapter_id: uuid.UUID,
    tenant_id: uuid.UUID,
    manifest: AdapterManifest,
    size: int,
    max_storage_bytes: int | None,
) -> None:
    """Count the adapter's bytes against max_storage_bytes and take a reference on its artifact (made if
    new), in one transaction, before the object is written: a sweep never deletes an object in use."""
    described = session.execute(
        update(Adapter)
        .where(Adapter.id == adapter_id)
        .values(sha256=manifest.sha256, bytes=size)
        .execution_options(synchronize_session=False)
    )
    if _rowcount(described) == 0:
        session.rollback()
        raise Conflict("the adapter was deleted while it was being uploaded")
    claim = update(StorageUsage).where(StorageUsage.tenant_id == tenant_id)
    if max_storage_bytes is not None:
        claim = claim.where(StorageUsage.bytes + size <= max_storage_bytes)
    if _rowcount(session.execute(claim.values(bytes=StorageUsage.bytes + size))) == 0:
        session.rollback()
        usage = storage_usage(session, tenant_id)
        raise Forbidden(
            f"the adapter ({size} bytes) does not fit this tenant's storage quota (max_storage_bytes "
            f"{max_storage_bytes}; {usage.bytes} bytes in use); delete an adapter first"
        )
    insert = _insert(session, Artifact).values(
        digest=manifest.sha256, uri=store.uri_of(manifest.sha256), bytes=size, refcount=1
    )
    session.execute(
        insert.on_conflict_do_update(
            index_elements=[Artifact.digest], set_={"refcount": Artifact.refcount + 1}
        )
    )
    session.commit()


def _mark_ready(session: Session, adapter_id: uuid.UUID, manifest: AdapterManifest, uri: str) -> None:
    ready = session.execute(
        update(Adapter)
        .where(Adapter.id == adapter_id)
        .values(
            status=AdapterStatus.READY,
            rank=max(manifest.ranks),
            target_modules=list(manifest.target_modules),
            storage_uri=uri,
        )
        .execution_options(synchronize_session=False)
    )
    if _rowcount(ready) == 0:
        session.rollback()
        raise Conflict("the adapter was deleted while it was being uploaded")
    session.commit()


@dataclass(frozen=True)
class _Released:
    digest: str | None  # the artifact it referenced (None: it had not got that far)


def _release(session: Session, adapter_id: uuid.UUID) -> _Released | None:
    """Delete an adapter row and give back what it held (its counts, its artifact reference), in one
    transaction. None if the row was gone already (released by someone else: nothing is given twice)."""
    row = session.execute(
        delete(Adapter)
        .where(Adapter.id == adapter_id)
        .returning(Adapter.tenant_id, Adapter.bytes, Adapter.sha256)
        .execution_options(synchronize_session=False)
    ).first()
    if row is None:
        session.rollback()
        return None
    tenant_id, size, digest = row
    session.execute(
        update(StorageUsage)
        .where(StorageUsage.tenant_id == tenant_id)
        .values(adapters=StorageUsage.adapters - 1, bytes=StorageUsage.bytes - size)
    )
    if digest is not None:
        session.execute(
            update(Artifact)
            .where(Artifact.digest == digest, Artifact.refcount > 0)
            .values(refcount=Artifact.refcount - 1)
        )
    session.commit()
    return _Released(digest)


def release_tenant(session: Session, tenant_id: uuid.UUID) -> None:
    """Give back the artifact references of every adapter of a tenant about to be deleted; the caller
    deletes the tenant (its adapter rows and counters cascade) and commits."""
    # Lock the tenant's adapter rows first (the order every writer here follows: adapter, then artifact).
    session.execute(
        update(Adapter)
        .where(Adapter.tenant_id == tenant_id)
        .values(name=Adapter.name)
        .execution_options(synchronize_session=False)
    )
    held = session.execute(
        select(Adapter.sha256, func.count())
        .where(Adapter.tenant_id == tenant_id, Adapter.sha256.is_not(None))
        .group_by(Adapter.sha256)
    ).all()
    for digest, count in held:
        session.execute(
            update(Artifact)
            .where(Artifact.digest == digest, Artifact.refcount >= count)
            .values(refcount=Artifact.refcount - count)
        )


def sweep_artifacts(session: Session, store: ArtifactStore, digests: Iterable[str] | None = None) -> int:
    """Delete unreferenced artifacts from the store, then their rows; how many were deleted. A store
    failure leaves the row (refcount 0) for the next sweep: nothing is lost, nothing leaks."""
    query = select(Artifact.digest).where(Artifact.refcount == 0)
    if digests is not None:
        query = query.where(Artifact.digest.in_(list(digests)))
    candidates = list(session.scalars(query.order_by(Artifact.created_at).limit(SWEEP_BATCH)))
    session.rollback()  # end the read: each candidate gets its own short transaction
    deleted = 0
    for digest in candidates:
        deleted += _sweep_one(session, store, digest)
    return deleted


def _sweep_one(session: Session, store: ArtifactStore, digest: str) -> int:
    # Lock the row while it is still unreferenced: an upload that wants this digest meanwhile waits for
    # the object and the row to be gone, then makes both again.
    locked = update(Artifact).where(Artifact.digest == digest, Artifact.refcount == 0).values(refcount=0)
    if _rowcount(session.execute(locked)) == 0:
        session.rollback()
        return 0
    uri = session.scalar(select(Artifact.uri).where(Artifact.digest == digest))
    try:
        if uri is not None:
            store.delete(uri)
    except StoreUnavailable as exc:
        session.rollback()
        log.warning("artifact %s not deleted yet, will retry: %s", digest, exc)
        return 0
    except AdapterError as exc:  # stored under another store's URI: not ours to delete any more
        log.warning("artifact %s dropped without deleting its object: %s", digest, exc)
    session.execute(delete(Artifact).where(Artifact.digest == digest, Artifact.refcount == 0))
    session.commit()
    log.info("artifact deleted", extra={"digest": digest})
    return 1


def storage_usage(session: Session, tenant_id: uuid.UUID) -> StorageUsagePublic:
    usage = session.get(StorageUsage, tenant_id, populate_existing=True)
    quota = quota_of(session, tenant_id)
    return StorageUsagePublic(
        adapters=usage.adapters if usage else 0,
        max_adapters=quota.max_adapters,
        bytes=usage.bytes if usage else 0,
        max_storage_bytes=quota.max_storage_bytes,
    )


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


def delete_adapter(
    session: Session, tenant_id: uuid.UUID, name: str, store: ArtifactStore | None = None
) -> None:
    """Delete the adapter, then its artifact from `store` if no other adapter uses it (without a store,
    the next sweep does that)."""
    adapter_id = session.scalar(
        select(Adapter.id).where(Adapter.tenant_id == tenant_id, Adapter.name == name)
    )
    released = _release(session, adapter_id) if adapter_id is not None else None
    if released is None:
        raise NotFound(f"no adapter named {name!r}")
    if store is not None:
        if released.digest is not None:
            sweep_artifacts(session, store, [released.digest])
        sweep_artifacts(session, store)  # and what earlier failures or deleted tenants left


def _insert(session: Session, table: type[Any]) -> Any:
    """INSERT with ON CONFLICT for the session's database (both speak it, through their own dialects)."""
    dialect = session.get_bind().dialect.name
    module = postgresql if dialect == "postgresql" else sqlite
    return module.insert(table)


def _ensure_usage_row(session: Session, tenant_id: uuid.UUID) -> None:
    session.execute(
        _insert(session, StorageUsage)
        .values(tenant_id=tenant_id, adapters=0, bytes=0)
        .on_conflict_do_nothing(index_elements=[StorageUsage.tenant_id])
    )


def _rowcount(result: Any) -> int:
    return int(result.rowcount)
