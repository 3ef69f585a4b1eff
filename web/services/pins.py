"""Pinned adapter versions: kept resident on every engine replica of their deployment, never evicted.

A tenant pins a version (within `quotas.max_pinned_adapters`; an admin without it) with
`POST /api/v1/adapters/{name}/pin`. The control plane asks each replica of the adapter's deployment to
register and pin it (wire.PINS_PATH) before it records the pin: if any replica answers 409 pool_full the
pin is undone on the replicas that took it and refused with the engine's sentence (it names the pool), and
nothing is recorded. A replica that cannot be reached is left to engine sync (services/engine_sync.py),
which compares every replica's pins with the database each pass and pins or unpins to match, so an
engine that restarts or is discovered later gets its pins within one pass. The database is the truth:
`adapters.pinned`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from loraplex import wire

from ..db.models import Adapter, AdapterStatus, Deployment
from ..db.session import Database
from ..schemas import AdapterPublic
from .adapters import find_adapter, find_version, to_public
from .errors import Conflict, Forbidden, NotFound
from .tenants import quota_of

log = logging.getLogger("loraplex.web.pins")

PIN_TIMEOUT_S = 120.0  # a pin loads the adapter's weights, as a prewarm does


class PoolRefused(Conflict):
    """An engine's pool cannot hold the pin (409, the engine's sentence naming the pool)."""


@dataclass(frozen=True)
class PinTarget:
    """The version to pin and where: its engine registration and its deployment's endpoints."""

    adapter_id: uuid.UUID
    name: str
    version: int
    uri: str
    sha256: str
    endpoints: list[str]

    @property
    def registration(self) -> wire.AdapterRegistration:
        return wire.AdapterRegistration(wire.adapter_name(str(self.adapter_id)), self.uri, self.sha256)


@dataclass
class PinOutcome:
    pinned: list[str] = field(default_factory=list)  # replicas that hold the pin now
    unreachable: dict[str, str] = field(default_factory=dict)  # replica -> why (engine sync retries)


def target(
    session: Session, tenant_id: uuid.UUID, name: str, version: int | None, enforce_quota: bool
) -> PinTarget:
    """The version to pin (None: the active one), checked: ready, and within the tenant's quota unless
    `enforce_quota` is off (an admin's pin)."""
    adapter = (
        find_adapter(session, tenant_id, name)
        if version is None
        else find_version(session, tenant_id, name, version)
    )
    if adapter is None:
        session.rollback()
        raise NotFound(
            f"no adapter named {name!r}" if version is None else f"adapter {name!r} has no version {version}"
        )
    if adapter.status != AdapterStatus.READY or not adapter.storage_uri or not adapter.sha256:
        session.rollback()
        raise Conflict(
            f"version {adapter.version} of adapter {name!r} is {adapter.status.value}; only a ready "
            "version can be pinned"
        )
    if enforce_quota and not adapter.pinned:
        limit = quota_of(session, tenant_id).max_pinned_adapters
        held = pinned_count(session, tenant_id)
        if limit is not None and held >= limit:
            session.rollback()
            raise Forbidden(
                f"this tenant has {held} pinned adapter version(s), its limit (max_pinned_adapters) is "
                f"{limit}: unpin one first, or ask an admin to raise it"
            )
    deployment = session.get(Deployment, adapter.deployment_id)
    assert deployment is not None
    found = PinTarget(
        adapter.id, name, adapter.version, adapter.storage_uri, adapter.sha256, list(deployment.endpoints)
    )
    session.rollback()
    return found


def pinned_count(session: Session, tenant_id: uuid.UUID) -> int:
    return (
        session.scalar(
            select(func.count()).select_from(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.pinned)
        )
        or 0
    )


def record(session: Session, adapter_id: uuid.UUID, pinned: bool) -> AdapterPublic:
    session.execute(update(Adapter).where(Adapter.id == adapter_id).values(pinned=pinned))
    session.commit()
    adapter = session.get(Adapter, adapter_id)
    if adapter is None:  # deleted meanwhile: nothing left to pin
        raise NotFound("the adapter was deleted meanwhile")
    session.refresh(adapter)
    return to_public(adapter)


def pinned_versions(
    session: Session, tenant_id: uuid.UUID, name: str, version: int | None
) -> list[PinTarget]:
    """The versions of `name` to unpin: `version`, or every pinned one. NotFound if the name (or that
    version) does not exist."""
    query = select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == name)
    rows = list(session.scalars(query))
    if not rows:
        session.rollback()
        raise NotFound(f"no adapter named {name!r}")
    if version is not None:
        rows = [r for r in rows if r.version == version]
        if not rows:
            session.rollback()
            raise NotFound(f"adapter {name!r} has no version {version}")
    else:
        rows = [r for r in rows if r.pinned]
    targets = []
    for row in rows:
        deployment = session.get(Deployment, row.deployment_id)
        endpoints = list(deployment.endpoints) if deployment is not None else []
        targets.append(
            PinTarget(row.id, name, row.version, row.storage_uri or "", row.sha256 or "", endpoints)
        )
    session.rollback()
    return targets


async def pin_on_engines(
    http: httpx.AsyncClient, token: str, replicas: list[str], pin: PinTarget
) -> PinOutcome:
    """Pin on every replica at once; PoolRefused (after undoing the pins made) when one's pool is full."""
    outcome = PinOutcome()
    refusals: list[str] = []

    async def one(replica: str) -> None:
        try:
            response = await http.post(
                replica + wire.PINS_PATH,
                json=pin.registration.body(),
                headers={wire.INTERNAL_TOKEN_HEADER: token},
                timeout=PIN_TIMEOUT_S,
            )
        except httpx.HTTPError as exc:
            outcome.unreachable[replica] = str(exc) or type(exc).__name__
            return
        if response.is_success:
            outcome.pinned.append(replica)
            return
        error = wire.parse_error(response.content)
        message = error.message if error else response.text[:300]
        if response.status_code == 409 and error is not None and error.code == wire.POOL_FULL:
            refusals.append(message)
        else:
            outcome.unreachable[replica] = f"{response.status_code}: {message}"

    await asyncio.gather(*(one(r) for r in replicas))
    if refusals:
        await unpin_on_engines(http, token, outcome.pinned, pin)
        raise PoolRefused(
            f"version {pin.version} of adapter {pin.name!r} cannot be pinned: an engine's pool cannot hold "
            f"it ({refusals[0]}); nothing was pinned"
        )
    return outcome


async def unpin_on_engines(http: httpx.AsyncClient, token: str, replicas: list[str], pin: PinTarget) -> None:
    """Best effort: a replica missed is unpinned by engine sync's next pass."""
    name = wire.adapter_name(str(pin.adapter_id))

    async def one(replica: str) -> None:
        try:
            await http.delete(
                replica + wire.pin_path(name), headers={wire.INTERNAL_TOKEN_HEADER: token}, timeout=30.0
            )
        except httpx.HTTPError as exc:
            log.info("unpin of %s on %s left to engine sync: %s", name, replica, exc)

    await asyncio.gather(*(one(r) for r in replicas))


def desired_pins(
    session: Session, deployment_endpoints: dict[uuid.UUID, list[str]]
) -> dict[uuid.UUID, list[wire.AdapterRegistration]]:
    """Per deployment, the registrations of its pinned ready versions (engine sync's target)."""
    rows = session.execute(
        select(Adapter.id, Adapter.deployment_id, Adapter.storage_uri, Adapter.sha256).where(
            Adapter.pinned, Adapter.status == AdapterStatus.READY
        )
    ).all()
    session.rollback()
    wanted: dict[uuid.UUID, list[wire.AdapterRegistration]] = {}
    for adapter_id, deployment_id, uri, sha256 in rows:
        if deployment_id in deployment_endpoints and uri:
            wanted.setdefault(deployment_id, []).append(
                wire.AdapterRegistration(wire.adapter_name(str(adapter_id)), uri, sha256)
            )
    return wanted


# -- what the APIs and the console call ---------------------------------------------------------------


def _db(app: Any) -> Database:
    db: Database = app.state.db
    return db


def _replicas_of(app: Any, endpoints: list[str]) -> list[str]:
    from .engine_sync import _may_have_the_token  # the same rule as every other call to the engines

    allow = app.state.settings.allow_loopback_endpoints
    permitted = [e for e in endpoints if _may_have_the_token(e, allow)]
    return [r.rstrip("/") for r in app.state.router.replicas(permitted)]


async def pin(
    app: Any, tenant_id: uuid.UUID, name: str, version: int | None, enforce_quota: bool = True
) -> AdapterPublic:
    """Pin the version (None: the active one) on its deployment's engines, then record it. NotFound,
    Conflict (not ready), Forbidden (over max_pinned_adapters), PoolRefused (an engine's pool is full:
    nothing pinned, nothing recorded)."""

    def plan() -> PinTarget:
        with _db(app).session() as session:
            return target(session, tenant_id, name, version, enforce_quota)

    found = await run_in_threadpool(plan)
    replicas = _replicas_of(app, found.endpoints)
    outcome = await pin_on_engines(app.state.http, app.state.engine_token, replicas, found)
    for replica, why in outcome.unreachable.items():
        log.info("pin of %s on %s left to engine sync: %s", found.registration.name, replica, why)

    def save() -> AdapterPublic:
        with _db(app).session() as session:
            return record(session, found.adapter_id, True)

    return await run_in_threadpool(save)


async def unpin(app: Any, tenant_id: uuid.UUID, name: str, version: int | None) -> AdapterPublic:
    """Unpin the version (None: every pinned version of the name); the adapter as its active version (or
    the version named). The engines are told at once, best effort; engine sync catches up the rest."""

    def forget() -> tuple[list[PinTarget], AdapterPublic]:
        with _db(app).session() as session:
            targets = pinned_versions(session, tenant_id, name, version)
            for found in targets:
                session.execute(update(Adapter).where(Adapter.id == found.adapter_id).values(pinned=False))
            session.commit()
            shown = (
                find_adapter(session, tenant_id, name)
                if version is None
                else find_version(session, tenant_id, name, version)
            )
            if shown is None:
                raise NotFound(f"no adapter named {name!r}")
            return targets, to_public(shown)

    targets, shown = await run_in_threadpool(forget)
    for found in targets:
        await unpin_on_engines(
            app.state.http, app.state.engine_token, _replicas_of(app, found.endpoints), found
        )
    return shown
