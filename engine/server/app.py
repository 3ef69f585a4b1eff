"""The HTTP side: OpenAI-compatible routes, internal adapter management, health, readiness, metrics.

The model loads in the background after startup, so /health answers at once (the process is alive)
and /ready turns 200 only once the model is loaded, the start adapters are registered and the engine
loop runs. Generation requests go through `AsyncEngine`; a request's status code is decided only
after its first output (or failure), so an adapter that cannot load still answers 422, not a broken
200 stream.

Trust: the gateway sends the internal token with tenant and adapter headers, in the terms of the wire
contract both sides import (loraplex.wire: header names, `id:` adapter names, error codes). With a token
configured (LORAPLEX_INTERNAL_TOKEN, as on every cluster), nothing but /health and /ready (kubelet's
probes) is served without it: 401, compared in constant time. /metrics needs it too (the operator's
autoscaler sends it; Prometheus may send it as `Authorization: Bearer`, which only /metrics reads).
Without a token configured, the tenant and adapter headers and the adapter-management endpoints are
refused, and /v1/ serves the base model and the adapters registered at start (`loraplex serve` alone).

Hostile input: every request body is capped (limits.MAX_REQUEST_BODY_BYTES, 413 unread), and every field
whose cost grows with its size is capped in protocol.py by the numbers of wire/limits.py (400 naming it).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import SecretStr
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex import wire
from loraplex.adapters import AdapterError, AdapterManifest
from loraplex.wire import limits
from loraplex.wire.errors import (
    AdapterUnavailable,
    EngineUnavailable,
    OpenAIError,
    OverShare,
    QueueFull,
    RefusedAdapterError,
    UnknownAdapterError,
    answer,
    failure_error,
)

from . import protocol
from .async_engine import NO_TENANT, AdapterFetchFailed, AsyncEngine, RequestStream, is_store_outage
from .delivery import (
    AbortingStreamingResponse,
    ClientGone,
    Delivery,
    Job,
    last_output,
    output_failure,
    unless_disconnected,
)
from .metrics import ServerMetrics, TenantLabels, tenant_label_key
from .protocol import bad_request
from .settings import ServerSettings

if TYPE_CHECKING:
    from loraplex.engine.engine import LLMEngine
    from loraplex.engine.lora.sources import AdapterFetcher
    from loraplex.engine.sampling_params import SamplingParams

log = logging.getLogger("loraplex.engine.server")


@dataclass(frozen=True)
class Caller:
    trusted: bool  # presented the right internal token
    tenant: wire.TenantRef = NO_TENANT  # with its fair share of the engine, from the gateway


def tenant_weight(request: Request) -> float:
    """The gateway's tenant weight header (read only from the token's holder): a positive finite
    number, 1 when absent; anything else is the gateway's bug, refused with a 400 that says so."""
    raw = request.headers.get(wire.TENANT_WEIGHT_HEADER)
    if raw is None:
        return 1.0
    try:
        weight = float(raw)
    except ValueError:
        weight = float("nan")
    if not (0 < weight < float("inf")):
        raise OpenAIError(
            400, f"{wire.TENANT_WEIGHT_HEADER} must be a positive number, got {raw!r}", wire.INVALID_REQUEST
        )
    return weight


class ServerState:
    """What the routes share: settings, metrics, and the engine once it has loaded."""

    def __init__(
        self,
        settings: ServerSettings,
        metrics: ServerMetrics,
        on_fatal: Callable[[str], None] | None = None,
    ):
        self.settings = settings
        self.metrics = metrics
        self.on_fatal = on_fatal
        self.engine: AsyncEngine | None = None
        self.load_error: str | None = None
        self.draining = False
        self.created = protocol.now()
        self._registering: dict[str, asyncio.Future[AdapterManifest]] = {}
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

    async def boot(self, factory: Callable[[], LLMEngine]) -> None:
        """Load the model off the event loop, start the engine loop, register the start adapters."""
        try:
            engine = await asyncio.to_thread(factory)
        except Exception as exc:
            self._fatal(f"the model failed to load: {exc}")
            return
        async_engine = AsyncEngine(
            engine, self.metrics, self.settings.max_queue, queue_shares=self.settings.queue_shares()
        )
        async_engine.start()
        for name, uri, sha256 in self.settings.start_adapters():
            try:
                await async_engine.register_adapter(name, await self.local_adapter(uri, sha256), sha256)
            except (AdapterError, EngineUnavailable) as exc:
                await async_engine.stop()
                self._fatal(f"adapter {name!r} could not be registered: {exc}")
                return
            log.info("registered adapter %s from %s", name, uri)
        self.engine = async_engine
        log.info("ready: serving %s", self.settings.model_name)

    def _fatal(self, message: str) -> None:
        log.error("%s", message)
        self.load_error = message
        if self.on_fatal is not None:
            self.on_fatal(message)

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.ready and not self.draining

    def not_ready_reason(self) -> str:
        if self.draining:
            return "draining: the server is shutting down"
        if self.load_error is not None:
            return self.load_error
        if self.engine is None:
            return "the model is loading"
        return self.engine.not_ready_reason

    def serving(self) -> AsyncEngine:
        """The engine, if it can take requests now; else a 503 that says why."""
        if self.engine is None or not self.engine.accepting or self.draining:
            raise answer(EngineUnavailable, f"not ready: {self.not_ready_reason()}")
        assert self.engine is not None
        return self.engine

    # -- trust ------------------------------------------------------------------------------------

    def presented_token(self, request: Request) -> bool:
        """True with the right internal token; False with none; a 401/403 with a wrong one."""
        presented = request.headers.get(wire.INTERNAL_TOKEN_HEADER)
        if presented is None:
            return False
        token = self.settings.internal_token
        if token is None:
            raise OpenAIError(
                403,
                "internal headers are refused: this server has no internal token (LORAPLEX_INTERNAL_TOKEN)",
                wire.PERMISSION_ERROR,
                wire.INTERNAL_TOKEN_NOT_CONFIGURED,
            )
        if not token_matches(presented, token):
            raise OpenAIError(
                401, "the internal token is wrong", wire.INVALID_REQUEST, wire.INVALID_INTERNAL_TOKEN
            )
        return True

    def require_internal(self, request: Request) -> None:
        if self.settings.internal_token is None:
            raise OpenAIError(
                403,
                "adapter management is disabled: this server has no internal token (LORAPLEX_INTERNAL_TOKEN)",
                wire.PERMISSION_ERROR,
                wire.INTERNAL_TOKEN_NOT_CONFIGURED,
            )
        if not self.presented_token(request):
            raise OpenAIError(
                401,
                f"adapter management needs the {wire.INTERNAL_TOKEN_HEADER} header",
                wire.INVALID_REQUEST,
                wire.MISSING_INTERNAL_TOKEN,
            )

    def caller(self, request: Request) -> Caller:
        """Who is calling /v1/: with a token configured, only the holder of it (the gateway)."""
        trusted = self.presented_token(request)
        sent = [h for h in wire.GATEWAY_HEADERS if h in request.headers]
        if sent and not trusted:
            if self.settings.internal_token is None:
                raise OpenAIError(
                    403,
                    f"{', '.join(sent)} refused: this server has no internal token configured",
                    wire.PERMISSION_ERROR,
                    wire.INTERNAL_TOKEN_NOT_CONFIGURED,
                )
            raise OpenAIError(
                401,
                f"{', '.join(sent)} need a valid {wire.INTERNAL_TOKEN_HEADER}",
                wire.INVALID_REQUEST,
                wire.MISSING_INTERNAL_TOKEN,
            )
        if not trusted and self.settings.internal_token is not None:
            raise OpenAIError(
                401,
                f"this engine serves only the gateway: send the {wire.INTERNAL_TOKEN_HEADER} header",
                wire.INVALID_REQUEST,
                wire.MISSING_INTERNAL_TOKEN,
            )
        if not trusted:
            return Caller(False)
        return Caller(True, wire.TenantRef(request.headers.get(wire.TENANT_HEADER), tenant_weight(request)))

    # -- which model ----------------------------------------------------------------------------------

    def is_base_model(self, model: str) -> bool:
        names = {self.settings.model_name}
        if self.settings.model:
            names.add(self.settings.model)
        return model in names

    async def adapter_for(self, request: Request, model: str, caller: Caller) -> str | None:
        """The engine adapter a request names (None: the base model), registering the gateway's lazily."""
        engine = self.serving()
        if caller.trusted:
            try:
                gateway_adapter = wire.adapter_from_headers(request.headers)
            except wire.BadHeaders as exc:
                raise bad_request(str(exc), code=exc.code) from exc
            if gateway_adapter is not None:
                name = gateway_adapter.name
                await self.ensure_adapter(engine, name, gateway_adapter.uri, gateway_adapter.sha256)
                return name
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

    async def ensure_adapter(self, engine: AsyncEngine, name: str, uri: str, sha256: str | None) -> None:
        """Register `name` unless it is already there with these weights; one registration at a time
        per name, shared by the requests that arrive meanwhile (and not cancelled if one leaves)."""
        known = engine.adapter(name)
        fresh = known is not None and (sha256 is None or known.sha256 == sha256.lower())
        if fresh and known is not None and known.failed is not None:
            # The same weights failed here before: refused with the reason until other weights come.
            raise answer(RefusedAdapterError, f"adapter {name!r}: {known.failed}")
        if fresh:
            return
        pending = self._registering.get(name)
        if pending is None:
            pending = asyncio.ensure_future(self.register(engine, name, uri, sha256, for_gateway=True))
            self._registering[name] = pending

            def forget(done: asyncio.Future[AdapterManifest]) -> None:
                self._registering.pop(name, None)
                if not done.cancelled():
                    done.exception()  # retrieved here, so an error nobody awaits logs no warning

            pending.add_done_callback(forget)
        await asyncio.shield(pending)

    async def register(
        self, engine: AsyncEngine, name: str, uri: str, sha256: str | None, for_gateway: bool = False
    ) -> AdapterManifest:
        """Register an adapter, answering an HTTP error that says why it was refused. For the gateway,
        in the wire contract's terms: the adapter at fault (adapter_failed), or its store unreachable
        (adapter_unavailable)."""
        try:
            manifest = await engine.register_adapter(name, await self.local_adapter(uri, sha256), sha256)
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
        log.info("registered adapter %s from %s", name, uri)
        return manifest

    # -- running requests ---------------------------------------------------------------------------------

    async def params(
        self,
        body: protocol._GenerationRequest,
        prompt_len: int,
        limit: int | None,
        logprobs: int | None,
        adapter: str | None = None,
    ) -> SamplingParams:
        """Sampling parameters, with the context checks a client can act on (400s naming the limits)."""
        engine = self.serving()
        context = engine.max_model_len
        if prompt_len >= context:
            raise bad_request(
                f"This model's maximum context length is {context} tokens, and the prompt has {prompt_len} "
                "tokens: it must be shorter to leave room for the completion.",
                code=wire.CONTEXT_LENGTH_EXCEEDED,
            )
        if limit is not None and prompt_len + limit > context:
            raise bad_request(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{prompt_len + limit} tokens ({prompt_len} in the prompt, {limit} for the completion). "
                "Please reduce the prompt or the completion length.",
                "max_tokens",
                wire.CONTEXT_LENGTH_EXCEEDED,
            )
        if limit is None:  # as much as the context (and the pool, less the adapter's pages) leaves
            known = engine.adapter(adapter) if adapter is not None else None
            pool_tokens = engine.pool_tokens - (known.pages if known else 0) * engine.page_size
            limit = max(1, min(context, pool_tokens, limits.MAX_COMPLETION_TOKENS) - prompt_len)
        try:
            return body.sampling_params(limit, logprobs)
        except ValueError as exc:  # limits.LimitExceeded among them: it names the field
            raise bad_request(str(exc), getattr(exc, "param", None), limit_code(exc)) from exc

    async def submit(self, job: Job) -> RequestStream:
        engine = self.serving()
        try:
            return await engine.add_request(job.prompt_ids, job.params, job.adapter, job.tenant)
        except (QueueFull, OverShare, EngineUnavailable) as exc:  # OverShare: other tenants still get in
            raise failure_error(exc) from exc
        except UnknownAdapterError as exc:  # these two before ValueError: each is one
            raise answer(UnknownAdapterError, f"The model `{job.model}` does not exist.") from exc
        except RefusedAdapterError as exc:
            raise answer(RefusedAdapterError, f"adapter {job.model!r}: {exc}") from exc
        except ValueError as exc:  # the engine's own checks (pool size, vocabulary) name the limit
            raise bad_request(str(exc), getattr(exc, "param", None), limit_code(exc)) from exc


def create_app(
    settings: ServerSettings | None = None,
    engine_factory: Callable[[], LLMEngine] | None = None,
    on_fatal: Callable[[str], None] | None = None,
) -> FastAPI:
    """The server app. `engine_factory` builds the engine (default: from `settings`); `on_fatal` is
    told when the model or a start adapter fails to load (the CLI exits then)."""
    settings = settings or ServerSettings()
    tenant_labels = None
    if settings.tenant_metrics:
        token = settings.internal_token.get_secret_value() if settings.internal_token else None
        tenant_labels = TenantLabels(settings.tenant_label_limit, tenant_label_key(token))
    metrics = ServerMetrics(tenant_labels, model_name=settings.model_name)
    state = ServerState(settings, metrics, on_fatal)

    def default_factory() -> LLMEngine:
        from loraplex.engine.engine import LLMEngine

        return LLMEngine(settings.engine_config())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        booting = asyncio.create_task(state.boot(engine_factory or default_factory))
        try:
            yield
        finally:
            state.draining = True
            booting.cancel()
            if state.engine is not None:
                await state.engine.stop()

    app = FastAPI(title="loraplex engine", version="1", lifespan=lifespan)
    app.state.server = state
    app.add_middleware(BodySizeLimit, max_bytes=limits.MAX_REQUEST_BODY_BYTES)
    app.add_middleware(InternalTokenGate, token=settings.internal_token)  # added last: runs first
    _install_error_handlers(app)
    _add_probe_routes(app, state)
    _add_generation_routes(app, state)
    _add_adapter_routes(app, state)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    async def openai_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, OpenAIError)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        errors = exc.errors()
        first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
        context = first.get("ctx")
        cause = context.get("error") if isinstance(context, dict) else None
        if isinstance(cause, limits.LimitExceeded):  # a cap of wire/limits.py: its own sentence and field
            return JSONResponse(
                wire.error_body(str(cause), wire.INVALID_REQUEST, wire.LIMIT_EXCEEDED, cause.param), 400
            )
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
        return JSONResponse(wire.error_body(message, wire.INVALID_REQUEST, param=where or None), 400)

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(RequestValidationError, validation_error)


def _add_probe_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        # Alive, also while loading or draining; a stopped engine loop will not come back, so the
        # process is reported dead and the liveness probe restarts it.
        if state.engine is not None and state.engine.dead is not None:
            return JSONResponse({"status": "dead", "reason": state.not_ready_reason()}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if state.ready:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "reason": state.not_ready_reason()}, 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        state.caller(request)
        engine = state.serving()
        base = state.settings.model_name

        def entry(name: str, parent: str | None) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": state.created,
                "owned_by": "loraplex",
                "root": base,
                "parent": parent,
            }

        adapters = [name for name in engine.adapter_names() if not wire.is_gateway_adapter(name)]
        return {"object": "list", "data": [entry(base, None), *(entry(n, base) for n in adapters)]}


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions", response_model=None)
    async def completions(body: protocol.CompletionRequest, request: Request) -> Response:
        caller = state.caller(request)
        body.refuse_unsupported()
        engine = state.serving()
        adapter = await state.adapter_for(request, body.model, caller)
        prompt = body.single_prompt()
        tokenizer = engine.tokenizer
        if isinstance(prompt, str):
            if tokenizer is None:
                raise bad_request("this model has no tokenizer: send the prompt as token ids", "prompt")
            ids = await asyncio.to_thread(tokenizer.encode, prompt)
        else:
            ids = prompt
        params = await state.params(body, len(ids), body.max_tokens, body.logprobs, adapter)
        job = Job(
            False, body.model, adapter, ids, params, body.stream, body.include_usage, caller.tenant
        )  # fmt: skip
        return await _run(state, job, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: protocol.ChatCompletionRequest, request: Request) -> Response:
        caller = state.caller(request)
        body.refuse_unsupported()
        engine = state.serving()
        adapter = await state.adapter_for(request, body.model, caller)
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise bad_request("this model has no tokenizer, so it has no chat template", "messages")
        try:
            ids = await asyncio.to_thread(tokenizer.encode_chat, body.template_messages())
        except OpenAIError:
            raise
        except Exception as exc:  # the template refused the conversation, or the tokenizer did
            raise bad_request(f"messages: {exc}", "messages") from exc
        params = await state.params(body, len(ids), body.token_limit, body.logprobs_wanted, adapter)
        job = Job(
            True, body.model, adapter, ids, params, body.stream, body.include_usage, caller.tenant
        )  # fmt: skip
        return await _run(state, job, request)


async def _run(state: ServerState, job: Job, request: Request) -> Response:
    engine = state.serving()
    stream = await state.submit(job)
    tokenizer = engine.tokenizer

    def text_of(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer else str(token_id)

    delivery = Delivery(job, text_of)
    handed_over = False
    try:
        try:
            if job.stream:
                first = await unless_disconnected(request, stream.next())
            else:
                first = await unless_disconnected(request, last_output(stream))
        except ClientGone:
            return Response(status_code=499)
        except OpenAIError:
            raise
        except Exception as exc:
            raise failure_error(exc) from exc
        broken = output_failure(first, job)
        if broken is not None:
            raise broken
        if not job.stream:
            return JSONResponse(delivery.whole(first))
        handed_over = True
        return AbortingStreamingResponse(delivery.events(first, stream), stream, engine)
    finally:
        if not handed_over and not stream.done:
            engine.abort(stream.request_id)


def _add_adapter_routes(app: FastAPI, state: ServerState) -> None:
    @app.get(wire.ADAPTERS_PATH)
    async def list_adapters(request: Request) -> dict[str, Any]:
        state.require_internal(request)
        engine = state.serving()

        data = [
            wire.AdapterEntry(
                name=a.name,
                sha256=a.sha256,
                resident=a.resident,
                failed=a.failed,
                admissions=a.admissions,
                cold_admissions=a.cold_admissions,
                loads=a.loads,
            )
            for a in await engine.adapters()
        ]
        return {"object": "list", "data": data}

    @app.post(wire.ADAPTERS_PATH, status_code=201, response_model=None)
    async def register_adapter(body: protocol.AdapterRegistration, request: Request) -> wire.Registered:
        state.require_internal(request)
        engine = state.serving()
        if state.is_base_model(body.name):
            raise bad_request(f"{body.name!r} is the base model's name; pick another adapter name", "name")
        manifest = await state.register(engine, body.name, body.uri, body.sha256)
        return wire.Registered(name=body.name, sha256=manifest.sha256, registered=True)

    @app.post(wire.PREWARM_PATH, response_model=None)
    async def prewarm_adapter(body: protocol.AdapterRegistration, request: Request) -> wire.Prewarmed:
        state.require_internal(request)
        engine = state.serving()
        if state.is_base_model(body.name):
            raise bad_request(f"{body.name!r} is the base model's name; pick another adapter name", "name")
        await state.ensure_adapter(engine, body.name, body.uri, body.sha256)
        try:
            level = await engine.warm_adapter(body.name)
        except UnknownAdapterError as exc:  # unregistered again between the two calls: worth a retry
            raise answer(AdapterUnavailable, f"adapter {body.name!r} was unregistered while warming") from exc
        except RefusedAdapterError as exc:
            raise answer(RefusedAdapterError, str(exc)) from exc
        except AdapterUnavailable as exc:
            raise answer(AdapterUnavailable, f"adapter {body.name!r}: {exc}") from exc
        facts = engine.adapter(body.name)
        sha256 = facts.sha256 if facts is not None else (body.sha256 or "")
        log.info("prewarmed adapter %s (%s)", body.name, level)
        return wire.Prewarmed(name=body.name, sha256=sha256, level=level)

    @app.delete(wire.ADAPTERS_PATH + "/{name:path}", response_model=None)
    async def unregister_adapter(name: str, request: Request) -> wire.Unregistered:
        state.require_internal(request)
        engine = state.serving()
        try:
            forgotten = await engine.unregister_adapter(name)
        except UnknownAdapterError as exc:  # not model_not_found: the name is an adapter's, not a model's
            raise OpenAIError(
                404, f"adapter {name!r} is not registered", wire.INVALID_REQUEST, wire.ADAPTER_NOT_FOUND
            ) from exc
        # New requests for it are refused from now on; while some still use it, it drains and is
        # forgotten (pages and host copy freed) when the last one ends.
        log.info("unregistered adapter %s%s", name, "" if forgotten else " (draining)")
        return wire.Unregistered(name=name, deleted=True, draining=not forgotten)


def limit_code(exc: ValueError) -> str | None:
    """The error code of a refused value: limit_exceeded for a bound of wire/limits.py, none for the rest."""
    return wire.LIMIT_EXCEEDED if isinstance(exc, limits.LimitExceeded) else None


def token_matches(presented: str, token: SecretStr) -> bool:
    """Constant time in the token: a guess learns nothing from how long the answer takes."""
    return hmac.compare_digest(presented.encode(), token.get_secret_value().encode())


OPEN_PATHS = frozenset({"/health", "/ready"})  # kubelet's probes carry no token
# Behind the token like the API (it shows what each adapter and tenant is doing); Prometheus can send a
# bearer token from a Secret but no header of ours, so this path also reads `Authorization: Bearer`.
METRICS_PATH = "/metrics"


class InternalTokenGate:
    """With a token configured, every path but OPEN_PATHS answers 401 to a request without it before
    its body is read or parsed (the API, its OpenAPI document, adapter management, metrics): a stranger
    learns nothing of the API and costs the engine nothing."""

    def __init__(self, app: ASGIApp, token: SecretStr | None):
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.token is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        presented = headers.get(wire.INTERNAL_TOKEN_HEADER.lower().encode())
        metrics = scope["path"] == METRICS_PATH
        if presented is None and metrics:
            presented = bearer_token(headers.get(b"authorization"))
        if presented is not None and token_matches(presented.decode("latin-1"), self.token):
            await self.app(scope, receive, send)
            return
        missing = presented is None
        asked = f"the {wire.INTERNAL_TOKEN_HEADER} header" + (" or Authorization: Bearer" if metrics else "")
        body = wire.error_body(
            f"this engine serves only the gateway: send {asked}"
            if missing
            else "the internal token is wrong",
            wire.INVALID_REQUEST,
            wire.MISSING_INTERNAL_TOKEN if missing else wire.INVALID_INTERNAL_TOKEN,
        )
        await JSONResponse(body, 401)(scope, receive, send)


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header (any case of the scheme); None without one."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" and token.strip() else None


class BodySizeLimit:
    """Refuses a request body over `max_bytes` (413) before any of it is parsed: by its Content-Length
    when it declares one, else while reading it, holding at most `max_bytes` in memory."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(scope, receive, send)
            return
        received: list[Message] = []
        size = 0
        while True:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            # The body as read, then the real channel (which reports the client hanging up).
            return received.pop(0) if received else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = wire.error_body(
            f"the request body is over {self.max_bytes} bytes, the most this server reads",
            wire.INVALID_REQUEST,
            wire.REQUEST_TOO_LARGE,
            "body",
        )
        await JSONResponse(body, 413)(scope, receive, send)
