"""Adapters: validate an upload against its deployment's base model, store it, and list or delete it.

An adapter is a name with versions. Each version is one `adapters` row with its own bytes (its digest),
status and id, and the engines know it by that id, so two versions of a name are two engine adapters. The
name's `adapter_names` row says which version the bare name addresses (the active one) and the last
version number given. Uploading under a name the tenant has creates its next version, which becomes active
once it is ready (an upload deploys); bytes the name already has as a ready version make no new version,
that version becomes active instead. Rollback (services/versions.py) makes another ready version active.

A version's status says where it is: UPLOADED (its row exists and its files have arrived), VALIDATING
(unpacked, being checked against the base model), READY (stored; the gateway routes it), or FAILED with
`error` saying why in words its tenant can act on: its upload was refused for its contents, it never
finished (the control plane stopped mid-upload), or an engine refused it at run time. A failed version is
kept, with its reason, until the next upload under its name replaces it (so refused uploads cannot pile up
rows without bound) or it is deleted. A name holds one upload in progress at a time. Refusals that are not
the upload's fault (quota, storage down) keep nothing. Deletes reach the engines through engine_sync.py.

Storage is content-addressed and reference-counted: a version's object in the artifact store is keyed by
its whole-adapter digest (config and weights) and shared by every version with that digest; the
`artifacts` row counts them, and the object is deleted once none is left. Quotas are enforced by single
conditional UPDATEs on the tenant's `storage_usage` counters, never by counting and then inserting, so
parallel uploads cannot overshoot them on SQLite or Postgres: max_adapters counts names (a new version of
a name never needs another), max_storage_bytes the bytes of every version.

Every transaction that writes takes its rows in one order (adapter name, then adapter, then storage_usage,
then artifact), and on SQLite its first statement is a write, so it holds the database's write lock from
its start.
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
from sqlalchemy.orm import Session, selectinload

from loraplex.adapters import (
    AdapterError,
    AdapterManifest,
    ArtifactStore,
    StoreUnavailable,
    inspect_adapter,
)
from loraplex.adapters.digest import ADAPTER_FILES

from ..db.models import Adapter, AdapterName, AdapterStatus, Artifact, Deployment, StorageUsage, utcnow
from ..schemas import AdapterPublic, AdapterVersionPublic, StorageUsagePublic
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
# The deployment a name's versions fit: one, so every version of a name serves the same base model.
OTHER_DEPLOYMENT = (
    "the versions of adapter {name!r} fit deployment {deployment!r}; upload this one to it, or delete the "
    "adapter first"
)


class StorageUnavailable(ServiceError):
    """The artifact store cannot be reached or refused our credentials: nothing was stored, try later."""

    status_code = 503


def to_public(adapter: Adapter) -> AdapterPublic:
    named = adapter.name_row
    return AdapterPublic(
        id=adapter.id,
        name=adapter.name,
        version=adapter.version,
        deployment=adapter.deployment.name,
        base_model=adapter.deployment.base_model,
        status=adapter.status.value,
        error=adapter.error,
        rank=adapter.rank,
        target_modules=list(adapter.target_modules),
        bytes=adapter.bytes,
        sha256=adapter.sha256,
        uploaded_by=adapter.uploaded_by,
        created_at=adapter.created_at,
        traffic=None if named is None or named.traffic is None else dict(named.traffic),
        sticky=True if named is None else named.sticky,
        pinned=adapter.pinned,
    )


def to_version(adapter: Adapter, named: AdapterName | None) -> AdapterVersionPublic:
    traffic = named.traffic if named is not None else None
    return AdapterVersionPublic(
        id=adapter.id,
        version=adapter.version,
        active=named is not None and adapter.version == named.active_version,
        weight=None if traffic is None else traffic.get(str(adapter.version), 0),
        status=adapter.status.value,
        error=adapter.error,
        sha256=adapter.sha256,
        bytes=adapter.bytes,
        rank=adapter.rank,
        uploaded_by=adapter.uploaded_by,
        created_at=adapter.created_at,
        pinned=adapter.pinned,
    )


@dataclass(frozen=True)
class Uploaded:
    """What an upload left: the version it made (created), or the version that already held its bytes."""

    adapter: AdapterPublic
    created: bool


def upload_adapter(
    session: Session,
    store: ArtifactStore,
    tenant_id: uuid.UUID,
    name: str,
    deployment_name: str,
    files: list[UploadedFile],
    upload_limit: int,
    uploaded_by: str | None = None,
) -> AdapterPublic:
    """upload_version's adapter: the version now active under `name` (the console and bootstrap's call)."""
    uploaded = upload_version(
        session, store, tenant_id, name, deployment_name, files, upload_limit, uploaded_by
    )
    return uploaded.adapter


def upload_version(
    session: Session,
    store: ArtifactStore,
    tenant_id: uuid.UUID,
    name: str,
    deployment_name: str,
    files: list[UploadedFile],
    upload_limit: int,
    uploaded_by: str | None = None,
) -> Uploaded:
    """Validate and store an adapter as the next version of `name` (its first when the name is new).
    Refused for its contents (Invalid, TooLarge): the version is kept FAILED with the reason, and the error
    raised. Refused for anything else: nothing is kept (no row, no artifact, no quota, no version number).
    Bytes that are a ready version of `name` already make no new version: that one becomes active."""
    deployment = deployments.by_name(session, deployment_name)
    quota = quota_of(session, tenant_id)
    _check_store(store)  # before anything is written: an upload the store cannot take is refused whole
    limit = upload_limit
    if quota.max_adapter_bytes is not None:
        limit = min(limit, quota.max_adapter_bytes)

    reserved = _reserve_version(session, tenant_id, deployment, name, quota.max_adapters, uploaded_by)
    if reserved.replaced:  # the failed versions it replaced, deleted from the store if nothing uses them
        sweep_artifacts(session, store, reserved.replaced)
    adapter_id = reserved.adapter_id
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
        existing = _same_bytes(session, adapter_id, manifest.sha256)
        if existing is not None:
            log.info("adapter upload matched a version", extra={"adapter": name, "digest": manifest.sha256})
            return Uploaded(existing, created=False)
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
    return Uploaded(get_version(session, tenant_id, name, reserved.version), created=True)


def _abandon(session: Session, store: ArtifactStore, adapter_id: uuid.UUID, digest: str | None) -> None:
    """An upload refused for a reason other than its contents keeps nothing: its row, counts and version
    number are given back, and its object (perhaps half written) is deleted if nothing else uses it."""
    session.rollback()
    release(session, adapter_id, give_back_number=True)
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


@dataclass(frozen=True)
class _Reserved:
    adapter_id: uuid.UUID
    version: int
    replaced: list[str]  # the digests of the failed versions the reservation deleted


def _reserve_version(
    session: Session,
    tenant_id: uuid.UUID,
    deployment: Deployment,
    name: str,
    max_adapters: int | None,
    uploaded_by: str | None,
) -> _Reserved:
    """Give the upload the name's next version number and its row, in one transaction: a new name counts
    against max_adapters; the name's failed versions (and uploads interrupted long ago) are replaced; the
    version is active from now if the name has no other (so the bare name tells how its upload goes)."""
    _ensure_usage_row(session, tenant_id)
    made = session.execute(
        _insert(session, AdapterName)
        .values(tenant_id=tenant_id, name=name, active_version=None, last_version=0)
        .on_conflict_do_nothing(index_elements=[AdapterName.tenant_id, AdapterName.name])
        .returning(AdapterName.name)
    ).first()
    new_name = int(made is not None)
    version, active = session.execute(
        update(AdapterName)
        .where(AdapterName.tenant_id == tenant_id, AdapterName.name == name)
        .values(last_version=AdapterName.last_version + 1)
        .returning(AdapterName.last_version, AdapterName.active_version)
    ).one()
    versions = session.execute(
        select(Adapter.id, Adapter.version, Adapter.status, Adapter.created_at, Adapter.deployment_id).where(
            Adapter.tenant_id == tenant_id, Adapter.name == name
        )
    ).all()
    replaced = [
        v for v in versions if v.status == AdapterStatus.FAILED or _interrupted(v.status, v.created_at)
    ]
    kept = [v for v in versions if v not in replaced]
    if any(v.status in IN_PROGRESS for v in kept):
        session.rollback()
        raise Conflict(f"a version of adapter {name!r} is being uploaded; retry when it is ready or failed")
    if any(v.deployment_id != deployment.id for v in kept):
        session.rollback()
        theirs = session.get(Deployment, kept[0].deployment_id)
        raise Conflict(OTHER_DEPLOYMENT.format(name=name, deployment=theirs.name if theirs else "?"))

    freed, digests = _delete_versions(session, [v.id for v in replaced])
    if active in {v.version for v in replaced}:
        active = None
    adapter = Adapter(
        tenant_id=tenant_id,
        deployment_id=deployment.id,
        name=name,
        version=version,
        status=AdapterStatus.UPLOADED,
        uploaded_by=uploaded_by,
    )
    session.add(adapter)
    session.flush()
    counted = update(StorageUsage).where(StorageUsage.tenant_id == tenant_id)
    if new_name and max_adapters is not None:
        counted = counted.where(StorageUsage.adapters < max_adapters)
    counted = counted.values(adapters=StorageUsage.adapters + new_name, bytes=StorageUsage.bytes - freed)
    if _rowcount(session.execute(counted)) == 0:
        session.rollback()
        raise Forbidden(
            f"this tenant already has its quota of {max_adapters} adapters (max_adapters); delete one first"
        )
    _drop_references(session, digests)
    if active is None:
        _set_active(session, tenant_id, name, version)
    session.commit()
    return _Reserved(adapter.id, version, sorted(set(digests)))


def _delete_versions(session: Session, adapter_ids: list[uuid.UUID]) -> tuple[int, list[str]]:
    """Delete version rows (their name row taken already): the bytes they held, and their digests."""
    freed, digests = 0, []
    for adapter_id in adapter_ids:
        row = session.execute(
            delete(Adapter)
            .where(Adapter.id == adapter_id)
            .returning(Adapter.bytes, Adapter.sha256)
            .execution_options(synchronize_session=False)
        ).first()
        if row is not None:
            freed += row.bytes
            if row.sha256 is not None:
                digests.append(row.sha256)
    return freed, digests


def _drop_references(session: Session, digests: list[str]) -> None:
    for digest in digests:
        session.execute(
            update(Artifact)
            .where(Artifact.digest == digest, Artifact.refcount > 0)
            .values(refcount=Artifact.refcount - 1)
        )


def _set_active(session: Session, tenant_id: uuid.UUID, name: str, version: int | None) -> None:
    session.execute(
        update(AdapterName)
        .where(AdapterName.tenant_id == tenant_id, AdapterName.name == name)
        .values(active_version=version)
    )


def lock_name(session: Session, tenant_id: uuid.UUID, name: str) -> AdapterName | None:
    """Take the name's row for this transaction (every writer takes it first); None: no such name."""
    row = session.execute(
        update(AdapterName)
        .where(AdapterName.tenant_id == tenant_id, AdapterName.name == name)
        .values(last_version=AdapterName.last_version)
        .returning(AdapterName.active_version, AdapterName.last_version, AdapterName.traffic)
    ).first()
    if row is None:
        return None
    return AdapterName(
        tenant_id=tenant_id,
        name=name,
        active_version=row.active_version,
        last_version=row.last_version,
        traffic=row.traffic,
    )


def _lock_name_of(session: Session, adapter_id: uuid.UUID) -> AdapterName | None:
    """Take the name row of version `adapter_id` first of all (a write, so SQLite's lock comes with it)."""
    of_version = select(Adapter.tenant_id, Adapter.name).where(Adapter.id == adapter_id)
    row = session.execute(
        update(AdapterName)
        .where(
            AdapterName.tenant_id == of_version.with_only_columns(Adapter.tenant_id).scalar_subquery(),
            AdapterName.name == of_version.with_only_columns(Adapter.name).scalar_subquery(),
        )
        .values(last_version=AdapterName.last_version)
        .returning(
            AdapterName.tenant_id,
            AdapterName.name,
            AdapterName.active_version,
            AdapterName.last_version,
            AdapterName.traffic,
        )
        .execution_options(synchronize_session=False)
    ).first()
    if row is None:  # the version is gone (deleted meanwhile)
        return None
    return AdapterName(
        tenant_id=row.tenant_id,
        name=row.name,
        active_version=row.active_version,
        last_version=row.last_version,
        traffic=row.traffic,
    )


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
    """The version is ready, and active: an upload deploys what it uploaded (unless a canary split holds
    the name's requests: then they stay where the split sends them, services/traffic.py)."""
    held = _lock_name_of(session, adapter_id)
    ready = session.execute(
        update(Adapter)
        .where(Adapter.id == adapter_id, Adapter.status == AdapterStatus.VALIDATING)
        .values(
            status=AdapterStatus.READY,
            rank=max(manifest.ranks),
            target_modules=list(manifest.target_modules),
            storage_uri=uri,
        )
        .returning(Adapter.tenant_id, Adapter.name, Adapter.version)
        .execution_options(synchronize_session=False)
    ).first()
    if ready is None:
        session.rollback()
        raise Conflict(GONE_WHILE_UPLOADING)
    if held is None or held.traffic is None:
        _set_active(session, ready.tenant_id, ready.name, ready.version)
    session.commit()


def _same_bytes(session: Session, adapter_id: uuid.UUID, digest: str) -> AdapterPublic | None:
    """The ready version of the upload's name with these bytes, made active in place of the upload
    (whose row and number are given back); None: the bytes are new to the name."""
    mine = session.get(Adapter, adapter_id)
    if mine is None:
        session.rollback()
        raise Conflict(GONE_WHILE_UPLOADING)
    twin = session.scalar(
        _query(mine.tenant_id).where(
            Adapter.name == mine.name,
            Adapter.id != adapter_id,
            Adapter.sha256 == digest,
            Adapter.status == AdapterStatus.READY,
        )
    )
    session.rollback()
    if twin is None:
        return None
    release(session, adapter_id, activate=twin.version, give_back_number=True)
    return get_version(session, twin.tenant_id, twin.name, twin.version)


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
class Released:
    digest: str | None  # the artifact it referenced (None: it had not got that far)


def release(
    session: Session,
    adapter_id: uuid.UUID,
    activate: int | None = None,
    give_back_number: bool = False,
    keep_active: bool = False,
) -> Released | None:
    """Delete one version row and give back what it held (its bytes, its artifact reference; with the
    name's last version, the name and its count), in one transaction. The name's active version becomes
    `activate` when given and still there; a released active version hands over to the newest version
    left, ready ones first; a split keeps the name's requests where it sends them. `give_back_number`:
    an upload that never became a version frees its number when it is still the last given.
    `keep_active`: Conflict, and nothing released, if the version is the active one or in the split.
    None if the row was gone already (nothing is given back twice)."""
    held = _lock_name_of(session, adapter_id)
    row = session.execute(
        delete(Adapter)
        .where(Adapter.id == adapter_id)
        .returning(Adapter.tenant_id, Adapter.name, Adapter.version, Adapter.bytes, Adapter.sha256)
        .execution_options(synchronize_session=False)
    ).first()
    if row is None:
        session.rollback()
        return None
    if keep_active and held is not None and held.active_version == row.version:
        session.rollback()
        raise Conflict(
            f"version {row.version} is the active version of adapter {row.name!r}; roll back to another "
            "version first, or delete the adapter"
        )
    if keep_active and held is not None and str(row.version) in (held.traffic or {}):
        session.rollback()
        raise Conflict(
            f"version {row.version} of adapter {row.name!r} is in its traffic split; change or end the "
            "split first"
        )
    left = session.execute(
        select(Adapter.version, Adapter.status)
        .where(Adapter.tenant_id == row.tenant_id, Adapter.name == row.name)
        .order_by(Adapter.version.desc())
    ).all()
    names_released = 0
    if not left:
        session.execute(
            delete(AdapterName).where(AdapterName.tenant_id == row.tenant_id, AdapterName.name == row.name)
        )
        names_released = 1
    elif held is not None:
        versions = {v.version for v in left}
        if activate is not None and activate in versions and held.traffic is None:
            _set_active(session, row.tenant_id, row.name, activate)
        elif held.active_version not in versions:
            ready = [v.version for v in left if v.status == AdapterStatus.READY]
            _set_active(session, row.tenant_id, row.name, (ready or [left[0].version])[0])
        if give_back_number and held.last_version == row.version:
            session.execute(
                update(AdapterName)
                .where(AdapterName.tenant_id == row.tenant_id, AdapterName.name == row.name)
                .values(last_version=row.version - 1)
            )
    session.execute(
        update(StorageUsage)
        .where(StorageUsage.tenant_id == row.tenant_id)
        .values(adapters=StorageUsage.adapters - names_released, bytes=StorageUsage.bytes - row.bytes)
    )
    if row.sha256 is not None:
        _drop_references(session, [row.sha256])
    session.commit()
    return Released(row.sha256)


def release_tenant(session: Session, tenant_id: uuid.UUID) -> None:
    """Give back the artifact references of every adapter of a tenant about to be deleted; the caller
    deletes the tenant (its adapter rows, names and counters cascade) and commits."""
    # Lock the tenant's names and adapter rows first (the order every writer here follows).
    session.execute(
        update(AdapterName)
        .where(AdapterName.tenant_id == tenant_id)
        .values(last_version=AdapterName.last_version)
        .execution_options(synchronize_session=False)
    )
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


def failed_holdings(session: Session, tenant_id: uuid.UUID) -> int:
    """The bytes the tenant's failed versions hold: room an upload that replaces them gets back."""
    size = session.scalar(
        select(func.coalesce(func.sum(Adapter.bytes), 0)).where(
            Adapter.tenant_id == tenant_id, Adapter.status == AdapterStatus.FAILED
        )
    )
    return int(size or 0)


def _query(tenant_id: uuid.UUID) -> Select[Adapter]:
    return (
        select(Adapter)
        .where(Adapter.tenant_id == tenant_id)
        .options(selectinload(Adapter.deployment), selectinload(Adapter.name_row))
    )


def _active(tenant_id: uuid.UUID) -> Select[Adapter]:
    """The tenant's active versions, one per name."""
    return _query(tenant_id).join(
        AdapterName,
        (AdapterName.tenant_id == Adapter.tenant_id)
        & (AdapterName.name == Adapter.name)
        & (AdapterName.active_version == Adapter.version),
    )


def list_adapters(session: Session, tenant_id: uuid.UUID) -> list[AdapterPublic]:
    """Each of the tenant's adapters by its name, as its active version."""
    return [to_public(a) for a in session.scalars(_active(tenant_id).order_by(Adapter.name))]


def find_adapter(session: Session, tenant_id: uuid.UUID, name: str) -> Adapter | None:
    """The active version of the tenant's adapter `name`, the one the bare name addresses."""
    return session.scalar(_active(tenant_id).where(Adapter.name == name))


def find_version(session: Session, tenant_id: uuid.UUID, name: str, version: int) -> Adapter | None:
    return session.scalar(_query(tenant_id).where(Adapter.name == name, Adapter.version == version))


def get_adapter(session: Session, tenant_id: uuid.UUID, name: str) -> AdapterPublic:
    adapter = find_adapter(session, tenant_id, name)
    if adapter is None:  # another tenant's adapter is as absent as a missing one
        raise NotFound(f"no adapter named {name!r}")
    return to_public(adapter)


def get_version(session: Session, tenant_id: uuid.UUID, name: str, version: int) -> AdapterPublic:
    adapter = find_version(session, tenant_id, name, version)
    if adapter is None:
        raise NotFound(f"adapter {name!r} has no version {version}")
    return to_public(adapter)


def delete_adapter(
    session: Session, tenant_id: uuid.UUID, name: str, store: ArtifactStore | None = None
) -> None:
    """Delete the adapter, every version of it, then their artifacts from `store` if nothing else uses
    them (without a store, the next sweep does that)."""
    if lock_name(session, tenant_id, name) is None:
        session.rollback()
        raise NotFound(f"no adapter named {name!r}")
    ids = list(
        session.scalars(select(Adapter.id).where(Adapter.tenant_id == tenant_id, Adapter.name == name))
    )
    freed, digests = _delete_versions(session, ids)
    session.execute(delete(AdapterName).where(AdapterName.tenant_id == tenant_id, AdapterName.name == name))
    session.execute(
        update(StorageUsage)
        .where(StorageUsage.tenant_id == tenant_id)
        .values(adapters=StorageUsage.adapters - 1, bytes=StorageUsage.bytes - freed)
    )
    _drop_references(session, digests)
    session.commit()
    if store is not None:
        sweep_artifacts(session, store, digests)
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
