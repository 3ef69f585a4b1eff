"""Engines forget deleted adapters: each engine replica's registrations are made to match the database.

The gateway registers an adapter on an engine lazily, under `id:<adapter id>` (loraplex.wire), the first
time it routes a request there; the engine keeps that registration, its pool pages and its host-memory
copy until told otherwise. Nothing is told at delete time alone, because that cannot be made reliable: a
replica may be down, restarting or unreachable at that moment, a pod may be scheduled a moment later with
an older view, and the control-plane replica that took the delete may die before it calls anyone. So
deletion is a reconciliation instead: `sync_once` lists each replica's registrations (GET
/internal/adapters) and unregisters every gateway name whose adapter the database no longer has ready
(deleted, replaced, or failed). The database is the only state; any control-plane replica can run it, a
missed pass loses nothing, and a replica that was away is cleaned on the first pass after it is back.

`EngineSync` runs that pass every `engine_sync_interval_s`, and at once when woken: a delete wakes it, so
a healthy engine forgets the adapter within moments while the deleting request never waits for an engine.
It also fails uploads interrupted long ago (services/adapters.py), and makes each replica's pins match the
pinned versions of its deployment (services/pins.py): a replica that restarted, or a pod discovered since,
gets its pins on the first pass that reaches it. All repair the world from the database on the same clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from loraplex import wire

from ..db.models import Adapter, AdapterStatus, Deployment
from ..db.session import Database
from . import adapters, pins
from .discovery import is_kubernetes_uri
from .endpoint_policy import endpoint_problem
from .routing import Router

log = logging.getLogger("loraplex.web.engine_sync")

# Replicas asked at once in one pass: enough for a large fleet, few enough not to swamp the control plane.
PARALLEL_REPLICAS = 16
# A registration list longer than this is not an engine's (one entry per adapter it has been sent).
MAX_LISTED = 100_000
# Ids looked up per query: well under SQLite's bound on parameters, small enough for any planner.
ID_BATCH = 500


@dataclass
class SyncReport:
    """What one pass did: the replicas it reached and could not, and the names it unregistered."""

    reached: list[str] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)  # replica URL -> why
    unregistered: dict[str, list[str]] = field(default_factory=dict)  # replica URL -> engine names
    pending: dict[str, list[str]] = field(default_factory=dict)  # names left for the next pass
    pinned: dict[str, list[str]] = field(default_factory=dict)  # replica URL -> names pinned this pass
    unpinned: dict[str, list[str]] = field(default_factory=dict)  # replica URL -> names unpinned this pass


def all_replicas(session: Session, router: Router, allow_loopback: bool = False) -> list[str]:
    """Every engine replica of every deployment, as routing sees them now (discovered pods included): an
    adapter may have been routed to any replica of its deployment, and its deployment may have changed.
    A static endpoint the token must not go to (a row written before endpoint_policy) is left out."""
    endpoints = [list(e) for e in session.scalars(select(Deployment.endpoints))]
    session.rollback()
    seen: dict[str, None] = {}
    for deployment_endpoints in endpoints:
        permitted = [e for e in deployment_endpoints if _may_have_the_token(e, allow_loopback)]
        for replica in router.replicas(permitted):
            seen.setdefault(replica.rstrip("/"), None)
    return list(seen)


def _may_have_the_token(endpoint: str, allow_loopback: bool) -> bool:
    if is_kubernetes_uri(endpoint):
        return True  # its pods: discovery accepts only the InferenceDeployment's own
    problem = endpoint_problem(endpoint, allow_loopback)
    if problem is not None:
        log.warning("engine sync skips deployment endpoint %s: it %s", endpoint[:100], problem)
    return problem is None


def stale_names(session: Session, names: Iterable[str]) -> list[str]:
    """The gateway names among `names` whose adapter is not ready in the database. Names that are not the
    gateway's (adapters an engine was started with) are never touched."""
    by_id: dict[uuid.UUID, str] = {}
    stale: list[str] = []
    for name in names:
        if not wire.is_gateway_adapter(name):
            continue
        text = wire.adapter_id_of(name)
        try:
            by_id[uuid.UUID(text or "")] = name
        except ValueError:  # not an id the gateway makes: nothing in the database can want it
            stale.append(name)
    ids = list(by_id)
    ready: set[uuid.UUID] = set()
    for start in range(0, len(ids), ID_BATCH):
        batch = ids[start : start + ID_BATCH]
        ready.update(
            session.scalars(
                select(Adapter.id).where(Adapter.id.in_(batch), Adapter.status == AdapterStatus.READY)
            )
        )
    session.rollback()
    stale.extend(name for adapter_id, name in by_id.items() if adapter_id not in ready)
    return sorted(stale)


async def registrations(http: httpx.AsyncClient, replica: str, token: str, timeout: float) -> list[str]:
    """The adapter names `replica` holds; httpx.HTTPError or ValueError when it cannot say."""
    return [e["name"] for e in await listing(http, replica, token, timeout)]


async def listing(http: httpx.AsyncClient, replica: str, token: str, timeout: float) -> list[dict[str, Any]]:
    """The adapters `replica` holds (wire.AdapterEntry, at least a name each); httpx.HTTPError or
    ValueError when it cannot say."""
    response = await http.get(
        replica + wire.ADAPTERS_PATH, headers={wire.INTERNAL_TOKEN_HEADER: token}, timeout=timeout
    )
    response.raise_for_status()
    body = response.json()
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or len(data) > MAX_LISTED:
        raise ValueError(f"{replica}{wire.ADAPTERS_PATH} did not answer a list of adapters")
    return [e for e in data if isinstance(e, dict) and isinstance(e.get("name"), str)]


async def unregister(http: httpx.AsyncClient, replica: str, name: str, token: str, timeout: float) -> bool:
    """Tell `replica` to forget `name`; whether it has (or never had it). False: try again next pass."""
    response = await http.delete(
        replica + wire.adapter_path(name), headers={wire.INTERNAL_TOKEN_HEADER: token}, timeout=timeout
    )
    if response.status_code == 404:  # gone already (another control-plane replica, or a restart)
        return True
    if response.is_success:
        return True
    error = wire.parse_error(response.content)
    # Not for the adapter's sake (an engine drains one still in use and answers 200): the engine is not
    # ready (loading, shutting down), refuses our token, or failed. Said, and asked again next pass.
    log.warning(
        "%s did not unregister %s yet (%s): %s",
        replica,
        name,
        response.status_code,
        error.message if error else response.text[:200],
    )
    return False


async def sync_replica(
    http: httpx.AsyncClient,
    db: Database,
    replica: str,
    token: str,
    timeout: float,
    report: SyncReport,
    wanted_pins: list[wire.AdapterRegistration] | None = None,
) -> None:
    try:
        # Listed before the database is read: an adapter made ready meanwhile is seen ready, so nothing
        # the gateway may be routing is unregistered (and that would only cost a re-registration).
        entries = await listing(http, replica, token, timeout)
    except (httpx.HTTPError, ValueError) as exc:
        report.unreachable[replica] = str(exc) or type(exc).__name__
        return
    names = [e["name"] for e in entries]
    report.reached.append(replica)
    stale = await run_in_threadpool(_stale_names, db, names)
    for name in stale:
        try:
            done = await unregister(http, replica, name, token, timeout)
        except httpx.HTTPError as exc:
            report.unreachable[replica] = str(exc) or type(exc).__name__
            done = False
        (report.unregistered if done else report.pending).setdefault(replica, []).append(name)
    await _sync_pins(http, replica, token, entries, set(stale), wanted_pins or [], report)


async def _sync_pins(
    http: httpx.AsyncClient,
    replica: str,
    token: str,
    entries: list[dict[str, Any]],
    stale: set[str],
    wanted: list[wire.AdapterRegistration],
    report: SyncReport,
) -> None:
    """Pin what the database has pinned for this replica's deployment and it lacks; unpin the gateway's
    names it holds pinned that the database does not. A failure is retried next pass."""
    held = {e["name"] for e in entries if e.get("pinned") is True and e["name"] not in stale}
    want = {r.name: r for r in wanted}
    headers = {wire.INTERNAL_TOKEN_HEADER: token}
    for name, registration in want.items():
        if name in held:
            continue
        try:
            response = await http.post(
                replica + wire.PINS_PATH,
                json=registration.body(),
                headers=headers,
                timeout=pins.PIN_TIMEOUT_S,
            )
        except httpx.HTTPError as exc:
            log.info("pin of %s on %s not made now: %s", name, replica, exc)
            continue
        if response.is_success:
            report.pinned.setdefault(replica, []).append(name)
        else:
            log.warning(
                "%s refused the pin of %s (%s): %s", replica, name, response.status_code, response.text[:200]
            )
    for name in held - set(want):
        if not wire.is_gateway_adapter(name):
            continue  # pins the engine's operator made by hand are left alone
        try:
            response = await http.delete(replica + wire.pin_path(name), headers=headers, timeout=30.0)
        except httpx.HTTPError:
            continue
        if response.is_success or response.status_code == 404:
            report.unpinned.setdefault(replica, []).append(name)


def _stale_names(db: Database, names: list[str]) -> list[str]:
    with db.session() as session:
        return stale_names(session, names)


def _replicas(db: Database, router: Router, allow_loopback: bool) -> list[str]:
    with db.session() as session:
        return all_replicas(session, router, allow_loopback)


def _pins_by_replica(
    db: Database, router: Router, allow_loopback: bool
) -> dict[str, list[wire.AdapterRegistration]]:
    """Per replica, the pinned versions of the deployments it serves."""
    with db.session() as session:
        deployments = {d.id: list(d.endpoints) for d in session.scalars(select(Deployment))}
        wanted = pins.desired_pins(session, deployments)
    by_replica: dict[str, list[wire.AdapterRegistration]] = {}
    for deployment_id, registrations in wanted.items():
        permitted = [e for e in deployments[deployment_id] if _may_have_the_token(e, allow_loopback)]
        for replica in router.replicas(permitted):
            by_replica.setdefault(replica.rstrip("/"), []).extend(registrations)
    return by_replica


async def sync_once(
    http: httpx.AsyncClient,
    db: Database,
    router: Router,
    token: str,
    timeout: float,
    allow_loopback: bool = False,
) -> SyncReport:
    """One pass over every replica: what each holds that the database no longer has ready, unregistered."""
    report = SyncReport()
    replicas = await run_in_threadpool(_replicas, db, router, allow_loopback)
    wanted_pins = await run_in_threadpool(_pins_by_replica, db, router, allow_loopback)
    limit = asyncio.Semaphore(PARALLEL_REPLICAS)

    async def one(replica: str) -> None:
        async with limit:
            await sync_replica(http, db, replica, token, timeout, report, wanted_pins.get(replica, []))

    await asyncio.gather(*(one(r) for r in replicas))
    for replica, names in report.unregistered.items():
        log.info("unregistered %d deleted adapter(s) on %s", len(names), replica, extra={"names": names})
    for replica, why in report.unreachable.items():
        log.info("engine %s not synced now, retried next pass: %s", replica, why)
    return report


def _fail_interrupted(db: Database) -> int:
    with db.session() as session:
        return adapters.fail_interrupted_uploads(session)


class EngineSync:
    """`sync_once` every `interval_s` and whenever woken, in the app's event loop, until stopped."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        db: Database,
        router: Router,
        token: str,
        interval_s: float,
        timeout_s: float,
        allow_loopback: bool = False,
    ):
        self.http, self.db, self.router, self.token = http, db, router, token
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.allow_loopback = allow_loopback  # settings.allow_loopback_endpoints
        self.passes = 0  # completed passes (tests wait on it)
        self.last: SyncReport | None = None
        self._wake = asyncio.Event()
        self._one_pass = asyncio.Lock()  # the loop's passes and one run by hand never overlap
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="engine-sync")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def wake(self) -> None:
        """Run a pass now (soon after the current one, if one is running); from any thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # not started, or stopped: the next start's passes will see the database as it is
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._wake.set)

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()
            try:
                await self.run_pass()
            except asyncio.CancelledError:
                raise
            except Exception:  # never fatal: the next pass tries again
                log.exception("engine sync pass failed")

    async def run_pass(self) -> SyncReport:
        async with self._one_pass:
            failed = await run_in_threadpool(_fail_interrupted, self.db)
            if failed:
                log.warning("failed %d upload(s) interrupted before they were validated", failed)
            report = await sync_once(
                self.http, self.db, self.router, self.token, self.timeout_s, self.allow_loopback
            )
            self.last = report
            self.passes += 1
            return report


def engine_sync_of(app: Any) -> EngineSync | None:
    """The app's EngineSync, once its lifespan started it."""
    return getattr(app.state, "engine_sync", None)


def wake(app: Any) -> None:
    """After a delete: tell the engines soon (never waiting for them here)."""
    sync = engine_sync_of(app)
    if sync is not None:
        sync.wake()
