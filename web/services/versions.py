"""An adapter's versions: list them, make another one active (rollback), delete one that is not active.
Uploading a version is services/adapters.py's; this module moves the name's pointer and prunes."""

from __future__ import annotations

import uuid

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from loraplex.adapters import ArtifactStore

from ..db.models import Adapter, AdapterName, AdapterStatus
from ..schemas import AdapterPublic, AdapterVersionPublic
from .adapters import find_version, get_version, lock_name, release, sweep_artifacts, to_version
from .errors import Conflict, NotFound


def list_versions(session: Session, tenant_id: uuid.UUID, name: str) -> list[AdapterVersionPublic]:
    """Every version of the tenant's adapter `name`, oldest first, the active one marked."""
    named = session.scalar(
        select(AdapterName).where(AdapterName.tenant_id == tenant_id, AdapterName.name == name)
    )
    rows = list(
        session.scalars(
            select(Adapter)
            .where(Adapter.tenant_id == tenant_id, Adapter.name == name)
            .order_by(Adapter.version)
        )
    )
    if not rows:  # another tenant's adapter is as absent as a missing one
        raise NotFound(f"no adapter named {name!r}")
    return [to_version(row, named) for row in rows]


def rollback(session: Session, tenant_id: uuid.UUID, name: str, version: int | None = None) -> AdapterPublic:
    """Make `version` the one the bare name addresses (None: the newest ready version older than the
    active one), ending any traffic split: it takes every request. Only a ready version can be made
    active. Requests already running finish on the version they started with; the next ones take the
    new one."""
    held = lock_name(session, tenant_id, name)
    if held is None:
        session.rollback()
        raise NotFound(f"no adapter named {name!r}")
    ready = list(
        session.scalars(
            select(Adapter.version).where(
                Adapter.tenant_id == tenant_id, Adapter.name == name, Adapter.status == AdapterStatus.READY
            )
        )
    )
    if version is None:
        earlier = [v for v in ready if held.active_version is None or v < held.active_version]
        if not earlier:
            session.rollback()
            raise Conflict(f"adapter {name!r} has no ready version before version {held.active_version}")
        version = max(earlier)
    elif version not in ready:
        session.rollback()
        if find_version(session, tenant_id, name, version) is None:
            raise NotFound(f"adapter {name!r} has no version {version}")
        raise Conflict(
            f"version {version} of adapter {name!r} is not ready; only a ready version can be active"
        )
    session.execute(
        update(AdapterName)
        .where(AdapterName.tenant_id == tenant_id, AdapterName.name == name)
        .values(active_version=version, traffic=None)
    )
    session.commit()
    return get_version(session, tenant_id, name, version)


def delete_version(
    session: Session, tenant_id: uuid.UUID, name: str, version: int, store: ArtifactStore | None = None
) -> None:
    """Delete one version that is not active nor in a traffic split, then its artifact from `store` if
    nothing else uses it."""
    adapter_id = session.scalar(
        select(Adapter.id).where(
            Adapter.tenant_id == tenant_id, Adapter.name == name, Adapter.version == version
        )
    )
    session.rollback()  # release takes the name first, in its own transaction
    released = release(session, adapter_id, keep_active=True) if adapter_id is not None else None
    if released is None:
        raise NotFound(f"adapter {name!r} has no version {version}")
    if store is not None and released.digest is not None:
        sweep_artifacts(session, store, [released.digest])
