"""The OpenAI-compatible gateway: key → tenant → adapter → replica, with quotas, streaming and usage."""

from __future__ import annotations

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
from pydantic import BaseModel, ConfigDict, Field

from ...db.session import Database
from ...schemas import PRINTABLE
from ...services import gateway, quotas, usage
from ...services.errors import QuotaExceeded
from ...services.keys import Principal
from ...services.tenants import quota_of
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
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.headers = status, message, kind, code, headers


def _error_response(status: int, message: str, kind: str, code: str | None = None, **kw: Any) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, **kw)


async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return _error_response(exc.status, exc.message, exc.kind, exc.code, headers=exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    if request.url.path.startswith("/v1/"):
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error_response(400, f"{where}: {first.get('msg')}", "invalid_request_error")
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


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(
        min_length=1, max_length=256, pattern=PRINTABLE, description="An adapter of yours, or a base model."
    )
    stream: bool = False
    max_tokens: int | None = Field(default=None, ge=1)


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)


class CompletionRequest(_Request):
    prompt: str | list[str]


@router.get("/models")
async def list_models(request: Request, principal: GatewayTenant) -> dict[str, Any]:
    db: Database = request.app.state.db

    def load() -> list[dict[str, Any]]:
        with db.session() as session:
            return gateway.list_models(session, principal.tenant_id)

    return {"object": "list", "data": await run_in_threadpool(load)}


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, principal: GatewayTenant
) -> Response:
    return await proxy(request, principal, body.model_dump(exclude_unset=True), "chat/completions")


@router.post("/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request, principal: GatewayTenant) -> Response:
    return await proxy(request, principal, body.model_dump(exclude_unset=True), "completions")


class _Call:
    """One gateway request's bookkeeping: its admission, and the usage row written when it ends."""

    def __init__(self, db: Database, principal: Principal, target: gateway.Target, endpoint: str):
        self.db, self.principal, self.target, self.endpoint = db, principal, target, endpoint
        self.started = time.monotonic()
        self.admission = quotas.Admission(minute=None, reserved=0)

    def admit(self, reserve: int) -> None:
        with self.db.session() as session:
            quota = quota_of(session, self.principal.tenant_id)
            self.admission = quotas.admit(session, self.principal.tenant_id, quota, reserve)

    def finish(self, status: str, prompt: int, completion: int, exact: bool) -> None:
        """Record usage and settle the reservation; never raises (the response is already decided)."""
        try:
            with self.db.session() as session:
                quotas.settle(session, self.principal.tenant_id, self.admission, prompt + completion)
                usage.record(
                    session,
                    usage.Usage(
                        tenant_id=self.principal.tenant_id,
                        api_key_id=self.principal.key_id,
                        adapter_id=self.target.adapter_id,
                        model=self.target.model,
                        endpoint=self.endpoint,
                        prompt_tokens=prompt,
                        completion_tokens=completion,
                        exact=exact,
                        latency_ms=int((time.monotonic() - self.started) * 1000),
                        status=status,
                    ),
                )
        except Exception:
            log.exception("could not record usage", extra={"tenant": str(self.principal.tenant_id)})


async def proxy(request: Request, principal: Principal, body: dict[str, Any], endpoint: str) -> Response:
    """Serve one OpenAI request for `principal`: resolve the model, admit it against the quotas, forward it
    to a replica (streams relayed as they come) and record its usage. The console's playground uses it
    too, so both paths account the same way."""
    app = request.app
    db: Database = app.state.db
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

    call = _Call(db, principal, target, endpoint)
    try:
        await run_in_threadpool(call.admit, gateway.reservation(body, app.state.settings.default_max_tokens))
    except QuotaExceeded as exc:
        raise OpenAIError(
            429,
            exc.message,
            "rate_limit_exceeded",
            "rate_limit_exceeded",
            headers={"Retry-After": str(exc.retry_after)},
        ) from None
    prompt_estimate = gateway.estimate_tokens(gateway.prompt_text(body))
    headers = gateway.upstream_headers(target, principal.tenant_id, app.state.engine_token)
    try:
        upstream = await _open(app, target, endpoint, body, headers)
    except httpx.TimeoutException:
        await run_in_threadpool(call.finish, "engine_timeout", 0, 0, True)
        raise OpenAIError(504, "The engine did not answer in time; retry later.", "server_error") from None
    except httpx.HTTPError:
        await run_in_threadpool(call.finish, "no_replica", 0, 0, True)
        raise OpenAIError(
            503,
            f"No engine replica of {target.base_model} is reachable; retry later.",
            "server_error",
            headers={"Retry-After": "5"},
        ) from None

    if upstream.status_code >= 400 or not streaming:
        try:
            content = await upstream.aread()
        finally:
            await upstream.aclose()
        if upstream.status_code >= 400:
            await run_in_threadpool(call.finish, f"engine_{upstream.status_code}", 0, 0, True)
        else:
            counted = gateway.usage_of_body(content)
            exact = counted is not None
            prompt = int(counted.get("prompt_tokens", 0)) if counted else prompt_estimate
            completion = int(counted.get("completion_tokens", 0)) if counted else 0
            await run_in_threadpool(call.finish, "ok", prompt, completion, exact)
        media = upstream.headers.get("content-type", "application/json")
        return Response(content, status_code=upstream.status_code, media_type=media)

    return StreamingResponse(
        _relay(upstream, call, gateway.Meter(prompt_estimate)),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _open(
    app: FastAPI, target: gateway.Target, endpoint: str, body: dict[str, Any], headers: dict[str, str]
) -> httpx.Response:
    """Send to the preferred replica for the adapter; on a refused connection, the next one."""
    client: httpx.AsyncClient = app.state.http
    last: httpx.HTTPError = httpx.ConnectError("the deployment has no endpoints")
    for replica in app.state.router.order(target.affinity_key, target.endpoints):
        request = client.build_request("POST", f"{replica}/v1/{endpoint}", json=body, headers=headers)
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


async def _relay(upstream: httpx.Response, call: _Call, meter: gateway.Meter) -> AsyncIterator[bytes]:
    """Pass each chunk on as it arrives (no buffering); record usage however the stream ends."""
    status = "client_disconnected"
    try:
        async for chunk in upstream.aiter_raw():
            meter.feed(chunk)
            yield chunk
        status = "ok"
    except httpx.HTTPError:
        status = "engine_error"
        yield b'data: {"error": {"message": "the engine stream broke off", "type": "server_error"}}\n\n'
    finally:
        # Runs on cancellation too (client gone): shielded so the record is written regardless.
        with anyio.CancelScope(shield=True):
            await upstream.aclose()
            prompt, completion, exact = meter.totals()
            if status == "ok" and not exact:
                status = "ok_estimated"
            await run_in_threadpool(call.finish, status, prompt, completion, exact)
