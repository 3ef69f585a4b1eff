"""The gateway's completions, free of HTTP: one tenant's OpenAI request, from its body to its usage record.

`Gateway.create` checks the body against the engine's caps, resolves `model` to an adapter or a base model,
admits the request against the tenant's quotas, sends it to the replica that holds the adapter (the next one
when a replica refuses the connection), and accounts it when it ends, however it ends. What it returns is
a domain result, never an HTTP response:
- `Completion`: the engine's whole answer (its JSON bytes, as the engine wrote them);
- `CompletionStream`: the engine's server-sent events as they arrive; closing it settles the request;
- `Refused`: the gateway's own verdict, in OpenAI's error terms (unknown model, a quota, no replica...);
- `EngineRefused`: the engine's error answer before it generated anything, passed on as it said, under
  the status the wire contract gives its code (an adapter at fault is marked failed).
The route (web/api/routes/gateway.py) and the console's playground both call it, so they account alike.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from fastapi.concurrency import run_in_threadpool

from loraplex import wire

from ..db.models import AdapterStatus
from ..db.session import Database
from . import adapters, gateway, metering, quotas
from .errors import QuotaExceeded
from .failure_reason import public_reason
from .in_flight import Busy, InFlight
from .keys import Principal
from .prewarm import Prewarmer
from .routing import Router, Work
from .scopes import KeyLimits, ScopeRefused, require_adapter, require_base_model, require_inference

log = logging.getLogger("loraplex.web.gateway")

# What a replica that produced nothing looks like from here: it refused the connection, or it took the
# request and closed the connection without a byte of answer (a pod going away drops the kept-alive
# connection the gateway just sent on: httpx says "Server disconnected without sending a response"). The
# next replica may take such a request. A timeout is not one of them: that replica may be working on it.
NO_ANSWER: tuple[type[httpx.HTTPError], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
)

# Seconds a client is told to wait when no replica (or the adapter store behind one) can serve it now.
RETRY_AFTER_S = 5

# Sent in place of the rest of a stream the engine broke off, so a client knows it ended early.
_BROKE_OFF = wire.WireError(
    "the engine stream broke off; the tokens sent so far are counted", wire.SERVER_ERROR, wire.ENGINE_ERROR
)
ENGINE_BROKE_OFF = f"data: {json.dumps(_BROKE_OFF.body())}\n\n".encode()


class Refused(Exception):
    """The gateway did not serve the request: `status` and `error` are what the tenant is told."""

    def __init__(self, status: int, error: wire.WireError, retry_after: int | None = None):
        super().__init__(error.message)
        self.status, self.error, self.retry_after = status, error, retry_after


def not_served(adapter: gateway.NotServed) -> Refused:
    """The caller's own adapter that is not ready: why, and what to do about it."""
    if adapter.status == AdapterStatus.FAILED:
        reason = adapter.error or "it cannot be used"
        message = (
            f"The adapter `{adapter.model}` failed and is not served: {reason}. "
            "Upload it again under this name to replace it."
        )
        return Refused(
            wire.ADAPTER_FAILED_STATUS, wire.WireError(message, wire.INVALID_REQUEST, wire.ADAPTER_FAILED)
        )
    status = adapter.status.value
    message = f"The adapter `{adapter.model}` is still being uploaded ({status}); retry when it is ready."
    return Refused(409, wire.WireError(message, wire.INVALID_REQUEST, wire.ADAPTER_NOT_READY))


def check_scope(limits: KeyLimits, target: gateway.Target | gateway.NotServed, model: str) -> None:
    """The key may call what `model` resolved to: its scope allows calls, and its adapter list the
    adapter (or its base-model flag the base model). Refused 403 naming the scope."""
    try:
        require_inference(limits)
        adapter = target.adapter_name  # None: the base model
        if adapter is not None:
            require_adapter(limits, adapter, "model")
        else:
            require_base_model(limits, model)
    except ScopeRefused as exc:
        raise Refused(403, exc.error) from None


class EngineRefused(Exception):
    """The engine answered an error before it generated anything: `content` is its answer, unchanged."""

    def __init__(
        self,
        status: int,
        content: bytes,
        media_type: str,
        error: wire.WireError | None,
        retry_after: int | None = None,
    ):
        super().__init__(
            error.message if error is not None and error.message else f"the engine answered {status}"
        )
        self.status, self.content, self.media_type = status, content, media_type
        self.error, self.retry_after = error, retry_after


def bad_request(exc: gateway.BadRequest) -> Refused:
    return Refused(exc.status, wire.WireError(exc.message, wire.INVALID_REQUEST, exc.code, exc.param))


@dataclass(frozen=True)
class Completion:
    """A finished completion: the engine's JSON answer as it sent it."""

    content: bytes
    status: int
    media_type: str

    def json(self) -> dict[str, Any]:
        """The answer parsed; ValueError when it is not a JSON object."""
        answer = json.loads(self.content)
        if not isinstance(answer, dict):
            raise ValueError("the engine's answer is not a JSON object")
        return answer


class CompletionStream:
    """The engine's SSE bytes as they arrive (nothing buffered), metered as they pass. Whoever takes a
    stream must `close()` it: that settles the request exactly once, however the stream ended (done, the
    engine gone, the reader gone, cancelled)."""

    def __init__(
        self,
        upstream: httpx.Response,
        call: metering.Call,
        meter: gateway.Meter,
        work: Work | None = None,
        wants_usage: bool = True,
    ):
        self.upstream, self.call, self.meter, self.work = upstream, call, meter, work
        # The engine is always asked for the usage chunk (metering reads it); the client sees it only if it
        # asked, as OpenAI's streams end: an unasked `choices: []` chunk breaks `chunk.choices[0]` loops.
        self.events = None if wants_usage else gateway.UsageChunkFilter()
        self.status = "client_disconnected"  # until the engine's stream is read to its end

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[bytes]:
        counted = 0
        try:
            async for chunk in self.upstream.aiter_raw():
                self.meter.feed(chunk)
                self.call.produce(self.meter.chunks - counted)
                counted = self.meter.chunks
                passed = chunk if self.events is None else self.events.feed(chunk)
                if passed:
                    yield passed
            if self.events is not None and (rest := self.events.rest()):
                yield rest
            self.status = "ok"
        except httpx.HTTPError:
            self.status = wire.ENGINE_ERROR
            yield ENGINE_BROKE_OFF

    async def close(self) -> None:
        # Shielded: a cancelled reader must still release the connection and settle its reservation.
        with anyio.CancelScope(shield=True):
            if self.work is not None:  # the pod's outstanding count drops however the stream ended
                self.work.done()
            await self.upstream.aclose()
            await self._settle()

    async def _settle(self) -> None:
        prompt, completion, exact = self.meter.totals()
        status = self.status
        error = self.meter.error
        if error is not None and error.code == wire.ADAPTER_FAILED and self.call.target.adapter_sha256:
            self.call.adapter_error = adapters.error_text(error.message)
            status = wire.ADAPTER_FAILED
        elif status == "ok" and not exact:
            status = "ok_estimated"
        await self.call.finish(
            status, prompt, completion, exact, cached=gateway.cached_tokens(self.meter.usage)
        )


@dataclass(frozen=True)
class Gateway:
    """What serving a completion needs: the database, the pooled client for the engines, the replica
    router, the engines' internal token, the default completion limit, and the clock quotas count by."""

    db: Database
    http: httpx.AsyncClient
    router: Router
    engine_token: str
    default_max_tokens: int
    clock: Callable[[], float] = time.time
    # This replica's requests in flight (one per app, on its state): caps and connection shares.
    in_flight: InFlight = field(default_factory=InFlight.defaults)
    # Warms pods that join an adapter's replica set (made in the app's lifespan; None: no prewarm).
    prewarmer: Prewarmer | None = None

    @classmethod
    def of(cls, state: Any) -> Gateway:
        """The gateway of an app, from what create_app keeps on its state (a test may set `clock`)."""
        return cls(
            db=state.db,
            http=state.http,
            router=state.router,
            engine_token=state.engine_token,
            default_max_tokens=state.settings.default_max_tokens,
            clock=getattr(state, "clock", time.time),
            in_flight=state.in_flight,
            prewarmer=getattr(state, "prewarmer", None),
        )

    async def complete(self, principal: Principal, body: dict[str, Any], endpoint: str) -> Completion:
        result = await self.create(principal, {**body, "stream": False}, endpoint)
        assert isinstance(result, Completion)
        return result

    async def stream(self, principal: Principal, body: dict[str, Any], endpoint: str) -> CompletionStream:
        result = await self.create(principal, {**body, "stream": True}, endpoint)
        assert isinstance(result, CompletionStream)
        return result

    async def create(
        self, principal: Principal, body: dict[str, Any], endpoint: str
    ) -> Completion | CompletionStream:
        """Serve one OpenAI request for `principal` on `endpoint` ("completions", "chat/completions" or
        "responses"): a stream when the body asks for one. Raises Refused or EngineRefused; settles the
        request's reservation however it ends before a stream is handed over."""
        try:
            require_inference(principal.limits)  # a read-only key is refused whatever it names
        except ScopeRefused as exc:
            raise Refused(403, exc.error) from None
        try:
            gateway.check_caps(body, endpoint)
        except gateway.BadRequest as exc:
            raise bad_request(exc) from None
        model = body["model"]
        caller = body.get("user") if isinstance(body.get("user"), str) else None
        target = await run_in_threadpool(self._resolve, principal, model, caller)
        if target is None:  # another tenant's adapter reads exactly like a missing one
            missing = f"The model `{model}` does not exist."
            raise Refused(404, wire.WireError(missing, wire.INVALID_REQUEST, wire.MODEL_NOT_FOUND))
        check_scope(principal.limits, target, model)
        if isinstance(target, gateway.NotServed):
            raise not_served(target)
        streaming = bool(body.get("stream"))
        # A Responses stream always ends with its usage (response.completed): nothing to ask or filter.
        wants_usage = endpoint == gateway.RESPONSES
        if streaming and not wants_usage:  # the final chunk then carries the engine's exact usage
            options = body.get("stream_options")
            options = options if isinstance(options, dict) else {}
            wants_usage = options.get("include_usage") is True
            body["stream_options"] = {**options, "include_usage": True}
        limit = gateway.set_completion_limit(body, endpoint, self.default_max_tokens)
        content = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
        if len(content) > gateway.MAX_REQUEST_BODY_BYTES:
            raise bad_request(
                gateway.BadRequest(None, "request body is too large to forward", 413, wire.REQUEST_TOO_LARGE)
            )
        prompt_estimate = gateway.estimate_prompt_tokens(body)

        call = metering.Call(self.db, principal, target, endpoint, self.clock, self.in_flight)
        try:
            await run_in_threadpool(call.admit, prompt_estimate, limit)
        except Busy as exc:  # its tenant's or key's cap, or its share of the connections
            raise Refused(429, exc.error, exc.retry_after) from None
        except QuotaExceeded as exc:
            error = wire.WireError(exc.message, wire.RATE_LIMITED, wire.RATE_LIMIT_EXCEEDED)
            raise Refused(429, error, exc.retry_after) from None
        except quotas.TooLargeForQuota as exc:
            error = wire.WireError(exc.message, wire.INVALID_REQUEST, wire.REQUEST_TOO_LARGE, "max_tokens")
            raise Refused(400, error) from None
        call.start_ticker()
        try:
            return await self._forward(call, endpoint, content, streaming, prompt_estimate, wants_usage)
        except BaseException:
            # Refused, failed or cancelled before a stream took the call over: settle it here (a no-op
            # when it was already settled), so the reservation is never left standing.
            await call.finish("client_disconnected", prompt_estimate, 0, False)
            raise

    def _resolve(
        self, principal: Principal, model: str, caller: str | None = None
    ) -> gateway.Target | gateway.NotServed | None:
        with self.db.session() as session:
            return gateway.resolve(session, principal.tenant_id, model, caller)

    async def _forward(
        self,
        call: metering.Call,
        endpoint: str,
        content: bytes,
        streaming: bool,
        prompt_estimate: int,
        wants_usage: bool = False,
    ) -> Completion | CompletionStream:
        target = call.target
        tenant = wire.TenantRef(str(call.principal.tenant_id), call.principal.fair_share_weight)
        headers = gateway.upstream_headers(target, tenant, self.engine_token)
        try:
            upstream, work = await self._open(target, endpoint, content, headers, prompt_estimate)
        except httpx.TimeoutException:
            await call.finish("engine_timeout", 0, 0, True)
            raise _engine_timeout() from None
        except httpx.HTTPError:
            await call.finish("no_replica", 0, 0, True)
            error = wire.WireError(
                f"No engine replica of {target.base_model} is reachable; retry later.", wire.SERVER_ERROR
            )
            raise Refused(503, error, RETRY_AFTER_S) from None

        if upstream.status_code < 400 and streaming:
            return CompletionStream(upstream, call, gateway.Meter(prompt_estimate), work, wants_usage)
        try:
            answer = await upstream.aread()
        except httpx.TimeoutException:
            await call.finish("engine_timeout", prompt_estimate, 0, False)
            raise _engine_timeout() from None
        except httpx.HTTPError:
            await call.finish(wire.ENGINE_ERROR, prompt_estimate, 0, False)
            error = wire.WireError("The engine's answer broke off; retry later.", wire.SERVER_ERROR)
            raise Refused(502, error) from None
        finally:
            work.done()
            await upstream.aclose()
        media = upstream.headers.get("content-type", "application/json")
        if upstream.status_code >= 400:
            raise await _engine_refused(call, upstream.status_code, answer, media)
        counted = gateway.usage_of_body(answer)
        if counted is not None:
            await call.finish(
                "ok",
                counted["prompt_tokens"],
                counted["completion_tokens"],
                True,
                True,
                gateway.cached_tokens(counted),
            )
        else:
            await call.finish("ok_estimated", prompt_estimate, 0, False, True)
        return Completion(answer, upstream.status_code, media)

    async def _open(
        self, target: gateway.Target, endpoint: str, content: bytes, headers: dict[str, str], tokens: int
    ) -> tuple[httpx.Response, Work]:
        """Send to the replica the router picks; where it answered nothing (NO_ANSWER), the next one. The
        request is outstanding on its replica (the router's load signal) until the returned work is done."""
        last: httpx.HTTPError = httpx.ConnectError("the deployment has no endpoints")
        headers = {**headers, "Content-Type": "application/json"}
        ref, key = target.adapter, target.affinity_key
        if self.prewarmer is not None and ref is not None and key is not None:
            self.prewarmer.remember(key, ref)  # what to register on a pod its set grows to
        replicas = self.router.order(key, target.endpoints, target.adapter_bytes)
        for i, replica in enumerate(replicas):
            request = self.http.build_request(
                "POST", f"{replica}/v1/{endpoint}", content=content, headers=headers
            )
            work = self.router.begin(replica, target.affinity_key, tokens)
            try:
                response = await self.http.send(request, stream=True)  # returns once the headers are in
            except NO_ANSWER as exc:
                work.done()
                log.warning("engine replica unreachable", extra={"replica": replica, "error": repr(exc)})
                self.router.mark_down(replica)
                last = exc
                continue
            except BaseException:
                work.done()
                raise
            if i + 1 < len(replicas) and await _not_ready(response):
                # Loading or draining (a pod scaled in): nothing was produced, the next replica takes it.
                work.done()
                await response.aclose()
                self.router.mark_down(replica)
                continue
            self.router.mark_up(replica)
            return response, work
        raise last


async def _not_ready(response: httpx.Response) -> bool:
    """The engine refused before doing anything because it is not serving now (503 not_ready). Its body
    is small and read here; whoever gets the response after this reads it from memory."""
    if response.status_code != 503:
        return False
    try:
        error = wire.WireError.from_body(json.loads(await response.aread()))
    except (ValueError, httpx.HTTPError):
        return False
    return error is not None and error.code == wire.NOT_READY


def _engine_timeout() -> Refused:
    return Refused(504, wire.WireError("The engine did not answer in time; retry later.", wire.SERVER_ERROR))


async def _engine_refused(call: metering.Call, status: int, answer: bytes, media: str) -> EngineRefused:
    """The engine's error answer, settled: nothing was produced. An adapter at fault is marked failed
    (422); a store the engine cannot reach is the platform's trouble (503), not the adapter's; anything
    else goes back as the engine said it."""
    error = wire.parse_error(answer)
    told, retry_after = status, None
    if error is not None and error.code == wire.ADAPTER_FAILED and call.target.adapter_sha256:
        call.adapter_error = adapters.error_text(error.message)
        told = wire.ADAPTER_FAILED_STATUS
        # The caller reads the reason as its adapter row keeps it: without the engine's names and ids.
        error = dataclasses.replace(error, message=adapters.error_text(public_reason(error.message)))
        answer, media = json.dumps(error.body()).encode(), "application/json"
    elif error is not None and error.code == wire.ADAPTER_UNAVAILABLE:
        told, retry_after = wire.ADAPTER_UNAVAILABLE_STATUS, RETRY_AFTER_S
    await call.finish(f"engine_{status}", 0, 0, True)
    return EngineRefused(told, answer, media, error, retry_after)
