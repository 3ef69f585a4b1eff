"""The HTTP side: OpenAI-compatible routes, internal adapter management, health, readiness, metrics.

The model loads in the background after startup, so /health answers at once (the process is alive)
and /ready turns 200 only once the model is loaded, the start adapters are registered and the engine
loop runs. Generation requests go through `AsyncEngine`; a request's status code is decided only
after its first output (or failure), so an adapter that cannot load still answers 422, not a broken
200 stream.

Trust: the gateway sends the internal token with tenant and adapter headers, in the terms of the wire
contract both sides import (loraplex.wire: header names, `id:` adapter names, error codes); trust.py
checks them. Adapters are fetched and registered by registrar.py; jobs.py builds a request's sampling
parameters and submits it. `ServerState` only composes these with the engine's lifecycle.

Hostile input: every request body is capped (limits.MAX_REQUEST_BODY_BYTES, 413 unread), and every field
whose cost grows with its size is capped in protocol.py by the numbers of wire/limits.py (400 naming it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex import wire
from loraplex.adapters import AdapterError
from loraplex.wire import limits
from loraplex.wire.errors import (
    AdapterUnavailable,
    EngineUnavailable,
    OpenAIError,
    RefusedAdapterError,
    UnknownAdapterError,
    answer,
    failure_error,
)

from . import jobs, protocol, responses, tokenization
from .async_engine import AsyncEngine, PoolFull
from .choices import Job, Prompt
from .delivery import (
    AbortingStreamingResponse,
    ClientGone,
    Delivery,
    Merged,
    abort_unfinished,
    failure_event,
    last_outputs,
    output_failure,
    unless_disconnected,
)
from .metrics import ServerMetrics, TenantLabels, tenant_label_key
from .protocol import bad_request
from .registrar import ArtifactFetcher, Registrar
from .settings import ServerSettings
from .tools import template_has_tools
from .trust import InternalTokenGate, TrustGate

if TYPE_CHECKING:
    from loraplex.engine.engine import LLMEngine

log = logging.getLogger("loraplex.engine.server")


class ServerState:
    """What the routes share, by job: settings and metrics, the trust checks (`trust`), the adapter
    fetcher and registrar (`fetcher`, `registrar`), and the engine once it has loaded."""

    def __init__(
        self,
        settings: ServerSettings,
        metrics: ServerMetrics,
        on_fatal: Callable[[str], None] | None = None,
    ):
        self.settings = settings
        self.metrics = metrics
        self.on_fatal = on_fatal
        self.trust = TrustGate(settings.internal_token)
        self.fetcher = ArtifactFetcher(settings)
        self.registrar = Registrar(settings, self.fetcher, metrics)
        self.engine: AsyncEngine | None = None
        self.load_error: str | None = None
        self.draining = False
        self.created = protocol.now()

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
        for adapter in self.settings.start_adapters():
            try:
                local = await self.fetcher.local_adapter(adapter.uri, adapter.sha256)
                await async_engine.register_adapter(adapter.name, local, adapter.sha256)
            except (AdapterError, EngineUnavailable) as exc:
                await async_engine.stop()
                self._fatal(f"adapter {adapter.name!r} could not be registered: {exc}")
                return
            log.info("registered adapter %s from %s", adapter.name, adapter.uri)
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
    tokenization.add_routes(app, state)  # vLLM's /tokenize and /detokenize
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

    async def http_error(request: Request, exc: Exception) -> Response:
        # Starlette's own answers (no such route: 404, a method the route does not take: 405) in
        # OpenAI's shape too, so a client reads every error of this server the same way.
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code not in (404, 405):
            return JSONResponse({"detail": exc.detail}, exc.status_code, headers=exc.headers)
        error = wire.route_error(exc.status_code, request.method, request.url.path)
        return JSONResponse(error.body(), exc.status_code, headers=exc.headers)

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)


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

    def model_cards(engine: AsyncEngine) -> list[dict[str, Any]]:
        """OpenAI's model objects (with vLLM's root and parent): the base model, then the adapters
        registered by name (the gateway's `id:` ones are its own business)."""
        base = state.settings.model_name

        def card(name: str, parent: str | None) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": state.created,
                "owned_by": "loraplex",
                "root": base,
                "parent": parent,
            }

        adapters = [name for name in engine.adapter_names() if not wire.is_gateway_adapter(name)]
        return [card(base, None), *(card(n, base) for n in adapters)]

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        state.trust.caller(request)
        return {"object": "list", "data": model_cards(state.serving())}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        state.trust.caller(request)
        found = next((c for c in model_cards(state.serving()) if c["id"] == model_id), None)
        if found is None:
            raise OpenAIError.of(404, wire.model_not_found(model_id))
        return found


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions", response_model=None)
    async def completions(body: protocol.CompletionRequest, request: Request) -> Response:
        caller = state.trust.caller(request)
        body.refuse_unsupported()
        engine = state.serving()
        adapter = await state.registrar.adapter_for(engine, request, body.model, caller)
        prompts = [await _completion_prompt(engine, body, adapter, p) for p in body.prompts()]
        job = Job(
            False, body.model, adapter, prompts, body.stream, body.include_usage, caller.tenant,
            n=body.choices_per_prompt, best_of=body.sequences_per_prompt, logprobs=body.logprobs,
            echo=body.echo, echo_only=body.echo_only, adapter_sha256=_routed_digest(request),
        )  # fmt: skip
        return await _run(state, job, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: protocol.ChatCompletionRequest, request: Request) -> Response:
        return await _run(state, await _chat_job(state, body, request), request)

    @app.post("/v1/responses", response_model=None)
    async def create_response(body: dict[str, Any], request: Request) -> Response:
        # OpenAI's Responses API, stateless: the chat request it means, written back as a Response.
        try:
            job = await _chat_job(state, responses.chat_request(body), request, "input")
            return await _run(state, job, request, responses.ResponsesDelivery.of(body))
        except OpenAIError as exc:  # the chat path's field names (max_tokens, ...) as the Responses API's
            exc.param = responses.responses_param(exc.param)
            raise


async def _chat_job(
    state: ServerState, body: protocol.ChatCompletionRequest, request: Request, field: str = "messages"
) -> Job:
    """A chat request tokenized through the chat template and resolved to its adapter; `field`: what a
    template's refusal names (`input` for the Responses API)."""
    caller = state.trust.caller(request)
    body.refuse_unsupported()
    engine = state.serving()
    adapter = await state.registrar.adapter_for(engine, request, body.model, caller)
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise bad_request("this model has no tokenizer, so it has no chat template", field)
    try:
        ids = await asyncio.to_thread(tokenizer.encode_chat, *chat_prompt(body, tokenizer.chat_template))
    except OpenAIError:
        raise
    except Exception as exc:  # the template refused the conversation, or the tokenizer did
        raise bad_request(f"{field}: {exc}", field) from exc
    params = jobs.sampling_params(engine, body, len(ids), body.token_limit, body.logprobs_wanted, adapter)
    n = body.choices_per_prompt
    return Job(
        True, body.model, adapter, [Prompt(ids, params)], body.stream, body.include_usage, caller.tenant,
        n=n, best_of=n, logprobs=body.logprobs_wanted, tools=body.tool_calls,
        adapter_sha256=_routed_digest(request),
    )  # fmt: skip


def _routed_digest(request: Request) -> str | None:
    """The adapter digest the gateway routed the request with (registrar.adapter_for), if any."""
    return getattr(request.state, "adapter_sha256", None)


def chat_prompt(
    body: protocol.ChatCompletionRequest, template: str | None
) -> tuple[list[dict[str, Any]], bool, list[dict[str, Any]] | None]:
    """encode_chat's arguments: the conversation, with the tools offered (engine/server/tools.py) in the
    template's own tools section when it has one, else in the generic format's system message."""
    calls = body.tool_calls
    if calls is None:
        return body.template_messages(), True, None
    native = template_has_tools(template)
    return calls.template_messages(body.messages, native), True, calls.template_tools() if native else None


async def _completion_prompt(
    engine: AsyncEngine, body: protocol.CompletionRequest, adapter: str | None, prompt: str | list[int]
) -> Prompt:
    """One prompt of a completions request, tokenized, with its sequences' parameters: max_tokens 0 (echo
    only) asks the engine for one token, dropped (choices.py); best_of asks for logprobs to rank by."""
    tokenizer = engine.tokenizer
    if isinstance(prompt, str):
        if tokenizer is None:
            raise bad_request("this model has no tokenizer: send the prompt as token ids", "prompt")
        ids = await asyncio.to_thread(tokenizer.encode, prompt)
    else:
        ids = prompt
        # Checked here as well as in the engine: echo decodes the ids before the engine sees them.
        bad = next((t for t in ids if not 0 <= t < engine.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"prompt token id {bad} is outside this model's vocabulary [0, {engine.vocab_size})", "prompt"
            )
    echo_text = ""
    if body.echo:
        echo_text = prompt if isinstance(prompt, str) else await asyncio.to_thread(_decode, engine, ids)
    limit = 1 if body.echo_only else body.max_tokens
    logprobs = body.logprobs
    if logprobs is None and body.sequences_per_prompt > body.choices_per_prompt:
        logprobs = 0  # the chosen tokens' logprobs rank the sequences; none are reported
    return Prompt(ids, jobs.sampling_params(engine, body, len(ids), limit, logprobs, adapter), echo_text)


def _decode(engine: AsyncEngine, ids: list[int]) -> str:
    tokenizer = engine.tokenizer
    return tokenizer.decode(ids, skip_special_tokens=False) if tokenizer else ""


async def _run(
    state: ServerState, job: Job, request: Request, deliver: Callable[..., Delivery] = Delivery
) -> Response:
    """Submit `job` and answer it: whole or streamed, in the shapes `deliver` writes (chat and completions
    by default; responses.ResponsesDelivery for /v1/responses)."""
    engine = state.serving()
    jobs.check_room(engine, job)
    streams = await jobs.submit(engine, job)
    tokenizer = engine.tokenizer

    def text_of(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer else str(token_id)

    delivery = deliver(job, streams, text_of)
    merged: Merged | None = None
    handed_over = False
    try:
        try:
            if job.stream:
                # The status is decided by the first output of any sequence (or its failure).
                merged = Merged(streams)
                first = await unless_disconnected(request, merged.get())
                broken = failure_event(first[1])
            else:
                outputs = await unless_disconnected(request, last_outputs(streams))
                broken = next((e for e in map(output_failure, outputs) if e is not None), None)
        except ClientGone:
            return Response(status_code=499)
        except OpenAIError:
            raise
        except Exception as exc:
            raise failure_error(exc) from exc
        if broken is not None:
            raise broken
        if not job.stream:
            return JSONResponse(delivery.whole(outputs))
        assert merged is not None
        handed_over = True
        return AbortingStreamingResponse(delivery.events(first, merged), streams, engine, merged)
    finally:
        if not handed_over:
            if merged is not None:
                merged.close()
            abort_unfinished(engine, streams)


def _add_adapter_routes(app: FastAPI, state: ServerState) -> None:
    @app.get(wire.ADAPTERS_PATH)
    async def list_adapters(request: Request) -> dict[str, Any]:
        state.trust.require_internal(request)
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
                pinned=a.pinned,
            )
            for a in await engine.adapters()
        ]
        return {"object": "list", "data": data}

    @app.post(wire.ADAPTERS_PATH, status_code=201, response_model=None)
    async def register_adapter(body: protocol.AdapterRegistration, request: Request) -> wire.Registered:
        state.trust.require_internal(request)
        engine = state.serving()
        if state.registrar.is_base_model(body.name):
            raise bad_request(f"{body.name!r} is the base model's name; pick another adapter name", "name")
        manifest = await state.registrar.register(engine, body.registration())
        return wire.Registered(name=body.name, sha256=manifest.sha256, registered=True)

    @app.post(wire.PREWARM_PATH, response_model=None)
    async def prewarm_adapter(body: protocol.AdapterRegistration, request: Request) -> wire.Prewarmed:
        state.trust.require_internal(request)
        engine = state.serving()
        if state.registrar.is_base_model(body.name):
            raise bad_request(f"{body.name!r} is the base model's name; pick another adapter name", "name")
        await state.registrar.ensure_adapter(engine, body.registration())
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

    @app.post(wire.PINS_PATH, response_model=None)
    async def pin_adapter(body: protocol.AdapterRegistration, request: Request) -> wire.Pinned:
        state.trust.require_internal(request)
        engine = state.serving()
        if state.registrar.is_base_model(body.name):
            raise bad_request(f"{body.name!r} is the base model's name; pick another adapter name", "name")
        await state.registrar.ensure_adapter(engine, body.registration())
        try:
            level = await engine.pin_adapter(body.name)
        except PoolFull as exc:
            raise OpenAIError(409, str(exc), wire.INVALID_REQUEST, wire.POOL_FULL, "name") from exc
        except UnknownAdapterError as exc:
            raise answer(AdapterUnavailable, f"adapter {body.name!r} was unregistered while pinning") from exc
        except RefusedAdapterError as exc:
            raise answer(RefusedAdapterError, str(exc)) from exc
        except AdapterUnavailable as exc:
            raise answer(AdapterUnavailable, f"adapter {body.name!r}: {exc}") from exc
        facts = engine.adapter(body.name)
        sha256 = facts.sha256 if facts is not None else (body.sha256 or "")
        log.info("pinned adapter %s (%s)", body.name, level)
        return wire.Pinned(name=body.name, sha256=sha256, level=level, pinned=True)

    @app.delete(wire.PINS_PATH + "/{name:path}", response_model=None)
    async def unpin_adapter(name: str, request: Request) -> wire.Unpinned:
        state.trust.require_internal(request)
        engine = state.serving()
        try:
            await engine.unpin_adapter(name)
        except UnknownAdapterError as exc:
            raise OpenAIError(
                404, f"adapter {name!r} is not registered", wire.INVALID_REQUEST, wire.ADAPTER_NOT_FOUND
            ) from exc
        return wire.Unpinned(name=name, pinned=False)

    @app.delete(wire.ADAPTERS_PATH + "/{name:path}", response_model=None)
    async def unregister_adapter(name: str, request: Request) -> wire.Unregistered:
        state.trust.require_internal(request)
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
