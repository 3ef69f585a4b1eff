"""The control plane's FastAPI application, made by `create_app(settings)`; nothing is created at import."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from loraplex.adapters import ArtifactStore

from . import console
from .api.limits import BodySizeLimit
from .api.routes import adapters, deployments, gateway, health, keys, storage, tenants, tokenize, usage
from .db.session import Database
from .services import adapters as adapters_service
from .services.deployments import all_endpoints
from .services.discovery import Discovery
from .services.engine_load import EngineLoadScraper
from .services.engine_sync import EngineSync
from .services.errors import QuotaExceeded, ServiceError
from .services.in_flight import InFlight
from .services.multipart import FORM_OVERHEAD_BYTES
from .services.prewarm import Prewarmer
from .services.routing import PlacementPolicy, Router
from .services.scopes import ScopeRefused
from .settings import Settings

log = logging.getLogger("loraplex.web")
# Upstream connections beyond the requests' own, for engine sync's registration calls.
SYNC_CONNECTIONS = 16


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    db = Database(settings.database_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # One pooled client per process for the engine replicas; made in the serving event loop.
        timeout = httpx.Timeout(
            settings.engine_read_timeout_s, connect=settings.engine_connect_timeout_s, pool=30.0
        )
        # Requests take at most upstream_connections of them (their shares: services/in_flight.py); the
        # rest are for engine sync, so a pool full of requests never stalls a sync pass.
        connections = settings.upstream_connections + SYNC_CONNECTIONS
        app.state.http = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=connections))
        # A pod that joins an adapter's replica set loads it before it takes the adapter's traffic.
        prewarmer = Prewarmer.over_http(app.state.http, app.state.engine_token)
        app.state.prewarmer = prewarmer
        app.state.router.subscribe(prewarmer.on_change)
        app.state.router.arrange = prewarmer.arrange
        # Engines forget deleted adapters: a pass every interval and after each delete.
        app.state.engine_sync = EngineSync(
            app.state.http,
            db,
            app.state.router,
            app.state.engine_token,
            settings.engine_sync_interval_s,
            settings.engine_connect_timeout_s,
            allow_loopback=settings.allow_loopback_endpoints,
        )
        # Each engine's own queue, read from its /metrics: the load every control-plane replica shares.
        scraper = None
        if settings.engine_load_interval_s > 0:
            scraper = EngineLoadScraper(
                app.state.http, app.state.engine_token, app.state.router, settings.engine_load_interval_s
            )
        app.state.engine_load = scraper
        # Objects whose last adapter was deleted while the store was down are deleted now.
        await run_in_threadpool(_sweep, db, app.state.store)
        try:
            # Follow the pods of every kubernetes:// deployment known now; later ones on first use.
            await run_in_threadpool(discovery.start, await run_in_threadpool(all_endpoints, db))
            app.state.engine_sync.start()
            if scraper is not None:
                scraper.start()
            yield
        finally:
            if scraper is not None:
                await scraper.stop()
            await prewarmer.close()
            await app.state.engine_sync.stop()
            await run_in_threadpool(discovery.stop)
            await app.state.http.aclose()
            db.dispose()

    app = FastAPI(
        title="loraplex control plane",
        version="0.1.0",
        description="Tenants, API keys, adapters, quotas, usage, and the OpenAI-compatible gateway.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.db = db
    app.state.pepper = settings.pepper()
    app.state.engine_token = settings.engine_token()
    # One artifact store for every upload and delete (routes, console, bootstrap), made once here.
    app.state.store = settings.artifact_store()
    discovery = Discovery(settings.kubernetes_discovery, settings.kubernetes_watch_timeout_s)
    app.state.discovery = discovery
    app.state.in_flight = InFlight.of(settings)
    policy = PlacementPolicy(
        saturation=settings.placement_saturation,
        cool_s=settings.placement_cool_s,
        idle_s=settings.placement_idle_s,
        pod_adapter_bytes=settings.placement_pod_adapter_bytes,
    )
    app.state.router = Router(cooldown_s=settings.endpoint_cooldown_s, discovery=discovery, policy=policy)

    app.add_middleware(
        BodySizeLimit,
        upload_paths=("/api/v1/adapters", "/console/adapters"),  # the console uploads adapters too
        upload_bytes=settings.max_upload_bytes + FORM_OVERHEAD_BYTES,  # files + multipart framing
    )
    app.add_exception_handler(ServiceError, _service_error)  # type: ignore[arg-type]
    for module in (health, tenants, deployments, keys, adapters, storage, usage, gateway, tokenize):
        app.include_router(module.router)
    gateway.install_error_handlers(app)
    console.install(app, settings)
    return app


def _sweep(db: Database, store: ArtifactStore) -> None:
    try:
        with db.session() as session:
            adapters_service.sweep_artifacts(session, store)
    except Exception:  # never fatal: the next start or delete retries
        log.exception("sweeping unreferenced artifacts failed")


async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, QuotaExceeded) else None
    body: dict[str, object] = {"detail": exc.message}
    if isinstance(exc, ScopeRefused):  # OpenAI's error shape too, its code naming the refusal
        body.update(exc.error.body())
    return JSONResponse(body, status_code=exc.status_code, headers=headers)
