"""The OpenAI-compatible gateway: key → tenant → adapter → replica, with quotas, streaming and usage."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.types import Receive, Scope, Send

from ...db.session import Database
from ...schemas import PRINTABLE
from ...services import gateway, metering, quotas
from ...services.errors import QuotaExceeded
from ...services.keys import Principal
from ..deps import Credentials, principal_of

log = logging.getLogger("loraplex.web.gateway")
router = APIRouter(prefix="/v1", tags=["gateway"])


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.headers = status, message, kind, code, headers
        self.param = param


def _error_response(
    status: int, message: str, kind: str, code: str | None = None, param: str | None = None, **kw: Any
) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, **kw)


async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return _error_response(exc.status, exc.message, exc.kind, exc.code, exc.param, headers=exc.headers)


def _field_of(error: Any) -> str:
    return ".".join(str(p) for p in error.get("loc", ()) if p != "body")


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    if request.url.path.startswith("/v1/"):
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        where = _field_of(first)
        return _error_response(400, f"{where}: {first.get('msg')}", "invalid_request_error", param=where)
    return await request_validation_exception_handler(request, exc)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _openai_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]


async def gateway_principal(request: Request, credentials: Credentials) -> Principal:
    principal = await run_in_threadpool(principal_of, request, credentials)
    if principal is None:
        raise OpenAIError(
            401,
            "Incorrect or missing API key: send `Authorization: Bearer lpx_...`.",
            "invalid_request_error",
            "invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return principal


GatewayTenant = Annotated[Principal, Depends(gateway_principal)]


def _bad_request(exc: gateway.BadRequest) -> OpenAIError:
    return OpenAIError(exc.status, exc.message, "invalid_request_error", exc.code, param=exc.param)


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(
        min_length=1, max_length=256, pattern=PRINTABLE, description="An adapter of yours, or a base model."
    )
    stream: bool = False
    max_tokens: int | None = Field(default=None, ge=1, le=gateway.limits.MAX_COMPLETION_TOKENS)


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1, max_length=gateway.limits.MAX_CHAT_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=gateway.limits.MAX_COMPLETION_TOKENS)


class CompletionRequest(_Request):
    prompt: str | list[str]


def _documented(model: type[BaseModel]) -> dict[str, Any]:
    """The body's schema for /openapi.json: the route reads the body itself (to bound it first)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


async def _body(request: Request, model: type[_Request]) -> dict[str, Any]:
    """The tenant's JSON, bounded and strictly parsed (no NaN, no inf), validated by `model`; what is
    forwarded is the validated dump, so a "5" for max_tokens reaches the engine as 5."""
    try:
        raw = gateway.parse_body(await request.body())
        parsed = model.model_validate(raw)
    except gateway.BadRequest as exc:
        raise _bad_request(exc) from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = _field_of(first) or "body"
        raise OpenAIError(400, f"{where}: {first.get('msg')}", "invalid_request_error", param=where) from None
    return parsed.model_dump(exclude_unset=True)


@router.get("/models")
async def list_models(request: Request, principal: GatewayTenant) -> dict[str, Any]:
    db: Database = request.app.state.db

    def load() -> list[dict[str, Any]]:
        with db.session() as session:
            return gateway.list_models(session, principal.tenant_id)

    return {"object": "list", "data": await run_in_threadpool(load)}


@router.post("/chat/completions", response_model=None, openapi_extra=_documented(ChatCompletionRequest))
async def chat_completions(request: Request, principal: GatewayTenant) -> Response:
    body = await _body(request, ChatCompletionRequest)
    return await proxy(request, principal, body, "chat/completions")


@router.post("/completions", response_model=None, openapi_extra=_documented(CompletionRequest))
async def completions(request: Request, principal: GatewayTenant) -> Response:
    body = await _body(request, CompletionRequest)
    return await proxy(request, principal, body, "completions")


async def proxy(request: Request, principal: Principal, body: dict[str, Any], endpoint: str) -> Response:
    """Serve one OpenAI request for `principal`: check its caps, resolve the model, admit it against the
    quotas, forward it to a replica (streams relayed as they come) and record its usage. The console's
    playground uses it too, so both paths account the same way."""
    app = request.app
    db: Database = app.state.db
    try:
        gateway.check_caps(body, endpoint)
    except gateway.BadRequest as exc:
        raise _bad_request(exc) from None
    model = body["model"]

    def resolve() -> gateway.Target | None:
        with db.session() as session:
            return gateway.resolve(session, principal.tenant_id, model)

    target = await run_in_threadpool(resolve)
    if target is None:  # another tenant's adapter reads exactly like a missing one
        raise OpenAIError(
            404, f"The model `{model}` does not exist.", "invalid_request_error", "model_not_found"
        )
    streaming = bool(body.get("stream"))
    if streaming:
        options = body.get("stream_options")
        body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    limit = gateway.set_completion_limit(body, endpoint, app.state.settings.default_max_tokens)
    content = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    if len(content) > gateway.MAX_REQUEST_BODY_BYTES:
        raise _bad_request(
            gateway.BadRequest(None, "request body is too large to forward", 413, "request_too_large")
        )
    prompt_estimate = gateway.estimate_tokens(gateway.prompt_text(body))

    call = metering.Call(db, principal, target, endpoint, getattr(app.state, "clock", time.time))
    try:
        await run_in_threadpool(call.admit, prompt_estimate, limit)
    except QuotaExceeded as exc:
        raise OpenAIError(
            429,
            exc.message,
            "rate_limit_exceeded",
            "rate_limit_exceeded",
            headers={"Retry-After": str(exc.retry_after)},
        ) from None
    except quotas.TooLargeForQuota as exc:
        raise OpenAIError(
            400, exc.message, "invalid_request_error", "request_too_large", param="max_tokens"
        ) from None
    call.start_ticker()
    try:
        return await _forward(app, call, target, endpoint, content, streaming, prompt_estimate)
    except BaseException:
        # Refused, failed or cancelled before a streamed response took the call over: settle it here
        # (a no-op when it was already settled), so the reservation is never left standing.
        await call.finish("client_disconnected", prompt_estimate, 0, False)
        raise


async def _forward(
    app: FastAPI,
    call: metering.Call,
    target: gateway.Target,
    endpoint: str,
    content: bytes,
    streaming: bool,
    prompt_estimate: int,
) -> Response:
    headers = gateway.upstream_headers(target, call.principal.tenant_id, app.state.engine_token)
    try:
        upstream = await _open(app, target, endpoint, content, headers)
    except httpx.TimeoutException:
        await call.finish("engine_timeout", 0, 0, True)
        raise OpenAIError(504, "The engine did not answer in time; retry later.", "server_error") from None
    except httpx.HTTPError:
        await call.finish("no_replica", 0, 0, True)
        raise OpenAIError(
            503,
            f"No engine replica of {target.base_model} is reachable; retry later.",
            "server_error",
            headers={"Retry-After": "5"},
        ) from None

    if upstream.status_code < 400 and streaming:
        return _Relay(upstream, call, gateway.Meter(prompt_estimate))
    try:
        answer = await upstream.aread()
    except httpx.TimeoutException:
        await call.finish("engine_timeout", prompt_estimate, 0, False)
        raise OpenAIError(504, "The engine did not answer in time; retry later.", "server_error") from None
    except httpx.HTTPError:
        await call.finish("engine_error", prompt_estimate, 0, False)
        raise OpenAIError(502, "The engine's answer broke off; retry later.", "server_error") from None
    finally:
        await upstream.aclose()
    if upstream.status_code >= 400:
        return await _engine_refused(call, upstream, answer)
    counted = gateway.usage_of_body(answer)
    if counted is not None:
        await call.finish("ok", counted["prompt_tokens"], counted["completion_tokens"], True, True)
    else:
        await call.finish("ok_estimated", prompt_estimate, 0, False, True)
    media = upstream.headers.get("content-type", "application/json")
    return Response(answer, status_code=upstream.status_code, media_type=media)


async def _engine_refused(call: metering.Call, upstream: httpx.Response, answer: bytes) -> Response:
    """The engine answered an error before generating: nothing was produced. An adapter at fault is
    marked failed (422); a store the engine cannot reach is the platform's trouble (503), not the
    adapter's; anything else goes back as the engine said it."""
    error = gateway.engine_error(answer) or {}
    status, headers = upstream.status_code, None
    if error.get("code") == gateway.ADAPTER_FAILED and call.target.adapter_sha256:
        call.adapter_error = gateway.adapter_error_text(error)
        status = 422
    elif error.get("code") == gateway.ADAPTER_UNAVAILABLE:
        status, headers = 503, {"Retry-After": "5"}
    await call.finish(f"engine_{upstream.status_code}", 0, 0, True)
    media = upstream.headers.get("content-type", "application/json")
    return Response(answer, status_code=status, media_type=media, headers=headers)


async def _open(
    app: FastAPI, target: gateway.Target, endpoint: str, content: bytes, headers: dict[str, str]
) -> httpx.Response:
    """Send to the preferred replica for the adapter; on a refused connection, the next one."""
    client: httpx.AsyncClient = app.state.http
    last: httpx.HTTPError = httpx.ConnectError("the deployment has no endpoints")
    headers = {**headers, "Content-Type": "application/json"}
    for replica in app.state.router.order(target.affinity_key, target.endpoints):
        request = client.build_request("POST", f"{replica}/v1/{endpoint}", content=content, headers=headers)
        try:
            response = await client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            log.warning("engine replica unreachable", extra={"replica": replica})
            app.state.router.mark_down(replica)
            last = exc
            continue
        app.state.router.mark_up(replica)
        return response
    raise last


ENGINE_BROKE_OFF = (
    b'data: {"error": {"message": "the engine stream broke off; the tokens sent so far are counted", '
    b'"type": "server_error", "param": null, "code": "engine_error"}}\n\n'
)


class _Relay(StreamingResponse):
    """The engine's SSE stream, passed on chunk by chunk as it arrives (no buffering). The call is
    settled when the response ends, however it ends: done, engine gone, client gone, or cancelled."""

    def __init__(self, upstream: httpx.Response, call: metering.Call, meter: gateway.Meter):
        self.upstream, self.call, self.meter = upstream, call, meter
        self.status = "client_disconnected"
        super().__init__(
            self._chunks(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _chunks(self) -> AsyncIterator[bytes]:
        counted = 0
        try:
            async for chunk in self.upstream.aiter_raw():
                self.meter.feed(chunk)
                self.call.produce(self.meter.chunks - counted)
                counted = self.meter.chunks
                yield chunk
            self.status = "ok"
        except httpx.HTTPError:
            self.status = "engine_error"
            yield ENGINE_BROKE_OFF

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()
                await self._settle()

    async def _settle(self) -> None:
        prompt, completion, exact = self.meter.totals()
        status = self.status
        error = self.meter.error
        if (
            error is not None
            and error.get("code") == gateway.ADAPTER_FAILED
            and self.call.target.adapter_sha256
        ):
            self.call.adapter_error = gateway.adapter_error_text(error)
            status = "adapter_failed"
        elif status == "ok" and not exact:
            status = "ok_estimated"
        await self.call.finish(status, prompt, completion, exact)
