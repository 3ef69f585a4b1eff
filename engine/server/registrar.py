"""Adapters onto the engine: fetching an artifact from the store (`ArtifactFetcher`), registering it
(`Registrar`: the gateway's lazily, one registration per name at a time), and which adapter a request names.

Every registration travels as one `wire.AdapterRegistration` (name, URI, digest): from a `--adapter` flag,
from the gateway's adapter headers (`wire.AdapterRef.registration()`), or from the internal endpoints.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from fastapi import Request

from loraplex import wire
from loraplex.adapters import AdapterError, AdapterManifest
from loraplex.wire.errors import AdapterUnavailable, OpenAIError, RefusedAdapterError, answer

from .async_engine import AdapterFetchFailed, AsyncEngine, is_store_outage
from .metrics import ServerMetrics
from .protocol import bad_request
from .settings import ServerSettings
from .trust import Caller

if TYPE_CHECKING:
    from loraplex.engine.lora.sources import AdapterFetcher

log = logging.getLogger("loraplex.engine.server")


class ArtifactFetcher:
    """Adapter artifacts as local directories, through LORAPLEX_ADAPTER_STORE (made on first use)."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self._fetcher: AdapterFetcher | None = None

    async def local_adapter(self, uri: str, sha256: str | None) -> str:
        """The adapter at `uri` as a local directory: fetched through LORAPLEX_ADAPTER_STORE (only URIs in
        it) and its digest verified (engine/lora/sources.py). AdapterUnavailable when the store does not
        answer; AdapterError when the adapter is not there or not what `sha256` names."""
        from loraplex.adapters import DigestMismatch, StoreUnavailable
        from loraplex.adapters.store import OutsideStore
        from loraplex.engine.lora.sources import AdapterFetcher

        if self._fetcher is None:
            settings = self.settings
            self._fetcher = AdapterFetcher.configure(
                settings.adapter_store, settings.adapter_cache_dir(), settings.s3_endpoint_url
            )
        try:
            directory = await asyncio.to_thread(
                self._fetcher.fetch, self.settings.resolve_adapter_uri(uri), sha256
            )
        except StoreUnavailable as exc:  # not the adapter's fault
            raise AdapterUnavailable(f"the adapter store could not be read: {exc}") from exc
        except OSError as exc:  # the store or the cache disk failing, or a URI no file can have
            if is_store_outage(exc):
                raise AdapterUnavailable(f"the adapter store could not be read: {exc}") from exc
            raise AdapterFetchFailed(f"nothing usable at {uri[:200]}: {exc.strerror}") from exc
        except OutsideStore as exc:  # the control plane and this engine disagree on the store: not its fault
            raise AdapterUnavailable(
                f"{exc}; the control plane and the engines must share LORAPLEX_ADAPTER_STORE"
            ) from exc
        except DigestMismatch:
            raise
        except AdapterError as exc:
            raise AdapterFetchFailed(str(exc)) from exc
        return str(directory)


class Registrar:
    """Registers adapters on the engine and says which one a request names."""

    def __init__(self, settings: ServerSettings, fetcher: ArtifactFetcher, metrics: ServerMetrics):
        self.settings = settings
        self.fetcher = fetcher
        self.metrics = metrics
        self._registering: dict[str, asyncio.Future[AdapterManifest]] = {}

    def is_base_model(self, model: str) -> bool:
        names = {self.settings.model_name}
        if self.settings.model:
            names.add(self.settings.model)
        return model in names

    async def adapter_for(
        self, engine: AsyncEngine, request: Request, model: str, caller: Caller
    ) -> str | None:
        """The engine adapter a request names (None: the base model), registering the gateway's lazily."""
        if caller.trusted:
            try:
                gateway_adapter = wire.adapter_from_headers(request.headers)
            except wire.BadHeaders as exc:
                raise bad_request(str(exc), code=exc.code) from exc
            if gateway_adapter is not None:
                await self.ensure_adapter(engine, gateway_adapter.registration())
                # The digest it was routed with: the engine runs it on no other weights (a
                # registration of the name that lands before it is queued refuses it, AdapterChanged).
                request.state.adapter_sha256 = gateway_adapter.sha256
                return gateway_adapter.name
        if self.is_base_model(model):
            return None
        # A tenant's adapter is reached only through the adapter headers the gateway sets, never by its
        # engine name in `model` (a body field a tenant writes), so no tenant can name another's.
        if not wire.is_gateway_adapter(model) and engine.adapter(model) is not None:
            return model
        if caller.trusted:
            return None  # the gateway resolved `model` to this deployment's base model
        raise OpenAIError(
            404, f"The model `{model}` does not exist.", wire.INVALID_REQUEST, wire.MODEL_NOT_FOUND
        )

    async def ensure_adapter(self, engine: AsyncEngine, adapter: wire.AdapterRegistration) -> None:
        """Register `adapter` unless it is already there with these weights; one registration at a time
        per name, shared by the requests that arrive meanwhile (and not cancelled if one leaves)."""
        name, sha256 = adapter.name, adapter.sha256
        known = engine.adapter(name)
        fresh = known is not None and (sha256 is None or known.sha256 == sha256.lower())
        if fresh and known is not None and known.failed is not None:
            # The same weights failed here before: refused with the reason until other weights come.
            raise answer(RefusedAdapterError, f"adapter {name!r}: {known.failed}")
        if fresh:
            return
        pending = self._registering.get(name)
        if pending is None:
            pending = asyncio.ensure_future(self.register(engine, adapter, for_gateway=True))
            self._registering[name] = pending

            def forget(done: asyncio.Future[AdapterManifest]) -> None:
                self._registering.pop(name, None)
                if not done.cancelled():
                    done.exception()  # retrieved here, so an error nobody awaits logs no warning

            pending.add_done_callback(forget)
        await asyncio.shield(pending)

    async def register(
        self, engine: AsyncEngine, adapter: wire.AdapterRegistration, for_gateway: bool = False
    ) -> AdapterManifest:
        """Register an adapter, answering an HTTP error that says why it was refused. For the gateway,
        in the wire contract's terms: the adapter at fault (adapter_failed), or its store unreachable
        (adapter_unavailable)."""
        name = adapter.name
        try:
            local = await self.fetcher.local_adapter(adapter.uri, adapter.sha256)
            manifest = await engine.register_adapter(name, local, adapter.sha256)
        except AdapterUnavailable as exc:
            self.metrics.adapter_registrations.labels("unavailable").inc()
            raise answer(AdapterUnavailable, f"adapter {name!r}: {exc}") from exc
        except AdapterError as exc:
            fetch = isinstance(exc, AdapterFetchFailed)
            self.metrics.adapter_registrations.labels("fetch_failed" if fetch else "invalid").inc()
            if for_gateway:  # nothing there, or something there that fails validation or verification
                raise answer(RefusedAdapterError, f"adapter {name!r}: {exc}") from exc
            if fetch:
                raise OpenAIError(
                    400, f"adapter {name!r}: {exc}", wire.INVALID_REQUEST, wire.ADAPTER_FETCH_FAILED
                ) from exc
            raise OpenAIError(
                422, f"adapter {name!r}: {exc}", wire.INVALID_REQUEST, wire.ADAPTER_INVALID
            ) from exc
        self.metrics.adapter_registrations.labels("ok").inc()
        log.info("registered adapter %s from %s", name, adapter.uri)
        return manifest
