"""Adapters: validate an upload against its deployment's base model, store it, and list or delete it.

An adapter's status says where it is: UPLOADED (its row exists and its files have arrived), VALIDATING
(unpacked, being checked against the base model), READY (stored; the gateway routes it), or FAILED with
`error` saying why in words its tenant can act on: its upload was refused for its contents, it never
finished (the control plane stopped mid-upload), or an engine refused it at run time. A FAILED adapter
keeps its name and counts against max_adapters (so refused uploads cannot pile up rows without bound);
uploading again under that name replaces it. Refusals that are not the adapter's fault (quota, storage
down, name taken) keep nothing. Deleting an adapter reaches the engines through services/engine_sync.py.

Storage is content-addressed and reference-counted: an adapter's object in the artifact store is keyed by
its whole-adapter digest (config and weights) and shared by every adapter row with that digest; the
`artifacts` row counts them, and the object is deleted once none is left. Quotas (adapters per tenant,
bytes per tenant) are enforced by single conditional UPDATEs on the tenant's `storage_usage` counters,
never by counting and then inserting, so parallel uploads cannot overshoot them on SQLite or Postgres.

Every transaction that writes takes its rows in one order (adapter, then storage_usage, then artifact),
and on SQLite its first statement is a write, so it holds the database's write lock from its start.
"""

from __future__ import annotations

import datetime as dt
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

from ..db.models import Adapter, AdapterStatus, Artifact, Deployment, StorageUsage, utcnow
from ..schemas import AdapterPublic, StorageUsagePublic
from . import deployments
from .errors import Conflict, Forbidden, Invalid, NotFound, ServiceError, TooLarge
from .failure_reason import public_reason
from .tenants import quota_of
from .uploads import UploadedFile, unpack

log = logging.getLogger("loraplex.web.adapters")

# Unreferenced artifacts deleted per sweep: bounded, so a store that is down never stalls a request long.
SWEEP_BATCH = 16
# An upload still UPLOADED or VALIDATING after this long was cut short (its control plane stopped): it is
# failed (`fail_interrupted_uploads`) and may be replaced. The body has arrived before the row exists, so
# what is left (unpack, validate, store) takes minutes at most even for the largest adapter.
INTERRUPTED_AFTER = dt.timedelta(minutes=30)
# The reason kept on a failed adapter: one printable line of bounded length.
MAX_ERROR_CHARS = 1000
INTERRUPTED = "the upload was interrupted before it was validated; upload the adapter again"
IN_PROGRESS = (AdapterStatus.UPLOADED, AdapterStatus.VALIDATING)
GONE_WHILE_UPLOADING = "the adapter was deleted or replaced while it was being uploaded; upload it again"


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
    """Validate and store an adapter. Refused for its contents (Invalid, TooLarge): the adapter is kept
    FAILED with the reason, and the error raised. Refused for anything else: nothing is kept (no row, no
    artifact, no quota)."""
    deployment = deployments.by_name(session, deployment_name)
    quota = quota_of(session, tenant_id)
    _check_store(store)  # before anything is written: an upload the store cannot take is refused whole
    limit = upload_limit
    if quota.max_adapter_bytes is not None:
        limit = min(limit, quota.max_adapter_bytes)

    _replace_failed(session, store, tenant_id, name)
    adapter_id = _reserve_adapter(session, tenant_id, deployment.id, name, quota.max_adapters)
    with tempfile.TemporaryDirectory(prefix="lpx-upload-") as work:
        directory = Path(work)
        try:
            manifest, size = _validate(session, adapter_id, files, directory, deployment, limit)
        except (Invalid, TooLarge) as refused:
            _fail_upload(session, adapter_id, refused.message)  # it holds no bytes and no artifact yet
            raise
        except BaseException:
            _abandon(session, store, adapter_id, None)
            raise
        try:
            _claim_storage(session, store, adapter_id, tenant_id, manifest, size, quota.max_storage_bytes)
            try:
                uri = store.put(directory, manifest.sha256)
            except StoreUnavailable as exc:
                raise StorageUnavailable(f"the adapter could not be stored: {exc}") from None
            _mark_ready(session, adapter_id, manifest, uri)
        except BaseException:
            _abandon(session, store, adapter_id, manifest.sha256)
            raise
    log.info("adapter ready", extra={"tenant": str(tenant_id), "adapter": name, "digest": manifest.sha256})
    return get_adapter(session, tenant_id, name)


def _abandon(session: Session, store: ArtifactStore, adapter_id: uuid.UUID, digest: str | None) -> None:
    """An upload refused for a reason other than its contents keeps nothing: its row and counts are given
    back, and its object (perhaps half written) is deleted if nothing else uses it."""
    session.rollback()
    _release(session, adapter_id)
    if digest is not None:
        sweep_artifacts(session, store, [digest])


def _validate(
    session: Session,
    adapter_id: uuid.UUID,
    files: list[UploadedFile],
    directory: Path,
    deployment: Deployment,
    limit: int,
) -> tuple[AdapterManifest, int]:
    """Unpack the upload into `directory` and check it against the deployment's base model: its manifest
    and size in bytes, or Invalid / TooLarge saying what is wrong with it."""
    unpack(files, directory, limit)
    _set_status(session, adapter_id, AdapterStatus.UPLOADED, AdapterStatus.VALIDATING)
    try:
        manifest = inspect_adapter(directory, deployments.shape_of(deployment))
    except AdapterError as exc:
        raise Invalid(f"adapter refused for {deployment.base_model}: {exc}") from None
    size = sum((directory / f).stat().st_size for f in ADAPTER_FILES)
    if size > limit:
        raise TooLarge(f"the adapter ({size} bytes) exceeds this tenant's {limit}-byte limit")
    return manifest, size


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
        tenant_id=tenant_id, deployment_id=deployment_id, name=name, status=AdapterStatus.UPLOADED
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
        .where(Adapter.id == adapter_id, Adapter.status == AdapterStatus.VALIDATING)
        .values(sha256=manifest.sha256, bytes=size)
        .execution_options(synchronize_session=False)
    )
    if _rowcount(described) == 0:
        session.rollback()
        raise Conflict(GONE_WHILE_UPLOADING)
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
        .where(Adapter.id == adapter_id, Adapter.status == AdapterStatus.VALIDATING)
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
        raise Conflict(GONE_WHILE_UPLOADING)
    session.commit()


def _set_status(
    session: Session, adapter_id: uuid.UUID, current: AdapterStatus, status: AdapterStatus
) -> None:
    """Move an upload on to `status`, unless it left `current` meanwhile (deleted, or failed as
    interrupted): then Conflict, and the upload stops."""
    moved = session.execute(
        update(Adapter)
        .where(Adapter.id == adapter_id, Adapter.status == current)
        .values(status=status)
        .execution_options(synchronize_session=False)
    )
    if _rowcount(moved) == 0:
        session.rollback()
        raise Conflict(GONE_WHILE_UPLOADING)
    session.commit()


def _fail_upload(session: Session, adapter_id: uuid.UUID, reason: str) -> None:
    """Keep an upload refused for its contents as FAILED with the reason (what the refusal said)."""
    session.rollback()  # whatever the refusal interrupted
    session.execute(
        update(Adapter)
        .where(Adapter.id == adapter_id, Adapter.status.in_(IN_PROGRESS))
        .values(status=AdapterStatus.FAILED, error=error_text(reason))
        .execution_options(synchronize_session=False)
    )
    session.commit()
    log.info("adapter upload refused", extra={"adapter_id": str(adapter_id), "reason": reason})


def _replace_failed(session: Session, store: ArtifactStore, tenant_id: uuid.UUID, name: str) -> None:
    """An upload under the name of a failed adapter (or of an upload interrupted long ago) replaces it:
    the old row goes with what it held, so the new one starts clean, under a new id (engines that
    registered the old one forget it: services/engine_sync.py)."""
    old = session.execute(
        select(Adapter.id, Adapter.status, Adapter.created_at).where(
            Adapter.tenant_id == tenant_id, Adapter.name == name
        )
    ).first()
    session.rollback()  # end the read; _release takes the row in its own transaction
    if old is None or not (old.status == AdapterStatus.FAILED or _interrupted(old.status, old.created_at)):
        return  # nothing there, or an adapter in use or being uploaded: the reservation answers 409
    released = _release(session, old.id)
    if released is not None and released.digest is not None:
        sweep_artifacts(session, store, [released.digest])


def _interrupted(status: AdapterStatus, created_at: dt.datetime) -> bool:
    if created_at.tzinfo is None:  # SQLite keeps no time zone; every time here is written in UTC
        created_at = created_at.replace(tzinfo=dt.UTC)
    return status in IN_PROGRESS and utcnow() - created_at > INTERRUPTED_AFTER


def fail_interrupted_uploads(session: Session, now: dt.datetime | None = None) -> int:
    """Fail the uploads that have been UPLOADED or VALIDATING for longer than any upload takes (their
    control plane stopped mid-upload), so their tenants see why and may upload again; how many."""
    cutoff = (now or utcnow()) - INTERRUPTED_AFTER
    result = session.execute(
        update(Adapter)
        .where(Adapter.status.in_(IN_PROGRESS), Adapter.created_at < cutoff)
        .values(status=AdapterStatus.FAILED, error=INTERRUPTED)
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return _rowcount(result)


def mark_failed(session: Session, adapter_id: uuid.UUID, reason: str) -> int:
    """An engine refused this adapter at run time (adapter_failed): it is failed with the engine's reason,
    stripped of ids (failure_reason.public_reason), and the gateway stops routing it. Only this row: other
    adapters with the same digest (another tenant's upload of the same bytes) were not what failed, and
    their engine names are checked on their own next use. How many rows changed (0 or 1)."""
    result = session.execute(
        update(Adapter)
        .where(Adapter.id == adapter_id, Adapter.status == AdapterStatus.READY)
        .values(status=AdapterStatus.FAILED, error=error_text(public_reason(reason)))
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return _rowcount(result)


def error_text(reason: str) -> str:
    """A reason as kept on an adapter row and shown to its tenant: one printable line, bounded."""
    text = "".join(c if c.isprintable() else " " for c in reason[: MAX_ERROR_CHARS * 2])
    return " ".join(text.split())[:MAX_ERROR_CHARS] or "the adapter cannot be used"


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


def failed_holdings(session: Session, tenant_id: uuid.UUID) -> tuple[int, int]:
    """How many of the tenant's adapters are failed, and the bytes they hold: room an upload that
    replaces one of them gets back."""
    count, size = session.execute(
        select(func.count(), func.coalesce(func.sum(Adapter.bytes), 0)).where(
            Adapter.tenant_id == tenant_id, Adapter.status == AdapterStatus.FAILED
        )
    ).one()
    return int(count), int(size)


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
