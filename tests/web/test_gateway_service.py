"""The gateway's completion service called directly, as the console's playground calls it: domain results
(a Completion, a CompletionStream settled when closed) and typed refusals, no HTTP response in sight."""

from __future__ import annotations

import ast
import asyncio
import json
import uuid
from collections.abc import Callable, Coroutine, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from loraplex import wire
from loraplex.web.db.session import Database
from loraplex.web.services.completions import (
    Completion,
    CompletionStream,
    EngineRefused,
    Gateway,
    Refused,
)
from loraplex.web.services.gateway import UsageChunkFilter
from loraplex.web.services.keys import Principal
from loraplex.web.services.routing import Router

from ..security.engine_stub import Engine
from .conftest import SHAPE, Api, loose, recorded_usage, upload
from .servers import serve

pytestmark = pytest.mark.timeout(60)
CHAT = "chat/completions"
T = TypeVar("T")


@dataclass
class Service:
    app: FastAPI
    engine: Engine
    principal: Principal
    pg_url: str
    adapter: dict[str, object]
    admin: TestClient
    headers: dict[str, str]

    def run(self, work: Callable[[Gateway], Coroutine[Any, Any, T]]) -> T:
        """`work` with a gateway of its own (a client and a database bound to this event loop)."""

        async def main() -> T:
            db = Database(self.pg_url)
            try:
                async with httpx.AsyncClient(timeout=10) as http:
                    gateway = Gateway(db, http, Router(cooldown_s=30.0), "internal-test-token", 16)
                    return await work(gateway)
            finally:
                db.dispose()

        return asyncio.run(main())

    def adapter_status(self) -> object:
        rows = self.admin.get("/api/v1/adapters", headers=self.headers).json()
        rows = rows["adapters"] if isinstance(rows, dict) else rows
        return next(r for r in rows if r["id"] == self.adapter["id"])["status"]


@pytest.fixture
def service(pg_url: str, app_factory: Callable[..., FastAPI], peft_dir: Path) -> Iterator[Service]:
    with ExitStack() as stack:
        engine = Engine()
        engine_url = stack.enter_context(serve(engine.app()))
        admin = stack.enter_context(TestClient(app_factory(pg_url)))
        api = Api(admin)
        api.deployment("tiny", "tiny-llama", [engine_url], shape=SHAPE)
        tenant, headers = api.tenant_with_key("acme")
        made = upload(admin, headers, loose(peft_dir), name="poet")
        assert made.status_code == 201, made.text
        principal = Principal(tenant_id=uuid.UUID(str(tenant["id"])), tenant_name="acme", key_id=None)
        yield Service(admin.app, engine, principal, pg_url, made.json(), admin, headers)  # type: ignore[arg-type]


def chat(model: str = "poet", **extra: object) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Write a poem."}], **extra}


def test_a_completion_is_the_engines_answer_and_is_recorded(service: Service) -> None:
    answer = service.run(lambda gateway: gateway.complete(service.principal, chat(), CHAT))
    assert isinstance(answer, Completion) and answer.status == 200
    assert answer.json()["usage"]["completion_tokens"] == 16  # the gateway's default limit, forwarded
    sent = service.engine.received[0]
    assert sent["body"]["max_tokens"] == 16 and sent["body"]["stream"] is False
    assert sent["headers"][wire.ADAPTER_SHA256_HEADER.lower()] == service.adapter["sha256"]
    (row,) = recorded_usage(service.app)
    assert (row.status, row.completion_tokens, row.exact, row.api_key_id) == ("ok", 16, True, None)


def test_a_stream_relays_the_engines_events_and_is_settled_when_closed(service: Service) -> None:
    async def read(gateway: Gateway) -> list[bytes]:
        stream = await gateway.stream(service.principal, chat(max_tokens=3), CHAT)
        assert isinstance(stream, CompletionStream)
        try:
            return [chunk async for chunk in stream]
        finally:
            await stream.close()

    data = b"".join(service.run(read))
    assert data.count(b'"text"') == 3 and data.endswith(b"data: [DONE]\n\n")
    assert service.engine.received[0]["body"]["stream_options"] == {"include_usage": True}
    (row,) = recorded_usage(service.app)
    assert (row.status, row.completion_tokens, row.exact) == ("ok", 3, True)


@pytest.mark.parametrize("options", [None, {}, {"include_usage": False}, {"include_usage": True}])
def test_a_stream_ends_with_a_usage_chunk_only_when_the_client_asked(
    service: Service, options: dict[str, Any] | None
) -> None:
    """The engine is always asked for usage (metering reads it); the client sees the `choices: []` chunk
    only with include_usage true, as OpenAI's streams end, so `chunk.choices[0]` loops never break."""

    async def read(gateway: Gateway) -> list[bytes]:
        extra = {} if options is None else {"stream_options": options}
        stream = await gateway.stream(service.principal, chat(max_tokens=3, **extra), CHAT)
        try:
            return [chunk async for chunk in stream]
        finally:
            await stream.close()

    data = b"".join(service.run(read))
    events = [json.loads(e[5:]) for e in data.split(b"\n\n") if e.startswith(b"data: {")]
    asked = bool(options and options.get("include_usage"))
    assert [e for e in events if e["choices"] == []] == ([events[-1]] if asked else [])
    assert all(e["choices"] for e in events[: len(events) - asked])
    assert data.endswith(b"data: [DONE]\n\n") and len(events) == 3 + asked
    (row,) = recorded_usage(service.app)
    assert (row.status, row.completion_tokens, row.exact) == ("ok", 3, True)  # metered exactly either way


def test_the_usage_filter_holds_back_only_an_event_s_own_bytes() -> None:
    usage = b'data: {"choices": [], "usage": {"completion_tokens": 2}}\n\n'
    text = b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
    stream = text + usage + b"data: [DONE]\n\n"
    for cut in range(len(stream) + 1):  # every way the bytes may be split into network chunks
        events = UsageChunkFilter()
        out = events.feed(stream[:cut]) + events.feed(stream[cut:]) + events.rest()
        assert out == text + b"data: [DONE]\n\n", cut
    events = UsageChunkFilter()
    assert events.feed(text[:10]) == b"" and events.feed(text[10:]) == text  # passed at its blank line


def test_a_stream_closed_early_is_settled_as_the_reader_gone(service: Service) -> None:
    async def first_only(gateway: Gateway) -> bytes:
        stream = await gateway.stream(service.principal, chat(max_tokens=8), CHAT)
        chunks = aiter(stream)
        try:
            return await anext(chunks)
        finally:
            await stream.close()
            await stream.close()  # closing twice settles once

    assert b'"text"' in service.run(first_only)
    rows = recorded_usage(service.app)
    assert [r.status for r in rows] == ["client_disconnected"]


def test_outstanding_work_is_counted_in_and_out_around_each_upstream_request(service: Service) -> None:
    """The router's load signal: a request counts on its pod while the engine has it, and stops counting
    however it ends (answered, streamed and closed, refused by the engine)."""
    seen: list[dict[str, int]] = []

    async def calls(gateway: Gateway) -> list[dict[str, int]]:
        counts = gateway.router.outstanding
        await gateway.complete(service.principal, chat(), CHAT)
        seen.append(dict(counts.requests))
        stream = await gateway.stream(service.principal, chat(max_tokens=3), CHAT)
        seen.append(dict(counts.requests))
        seen.append(dict(counts.by_key))
        try:
            async for _ in stream:
                pass
        finally:
            await stream.close()
        seen.append(dict(counts.requests))
        service.engine.refuse = (400, wire.ADAPTER_UNAVAILABLE, "the store is down")
        with pytest.raises(EngineRefused):
            await gateway.complete(service.principal, chat(), CHAT)
        seen.append(dict(counts.requests) | dict(counts.by_key))
        return seen

    done, streaming, by_key, closed, refused = service.run(calls)
    assert done == {} and closed == {} and refused == {}
    assert list(streaming.values()) == [1]
    assert by_key == {f"adapter:{service.adapter['sha256']}": 1}


def refusal(service: Service, body: dict[str, Any]) -> Refused:
    async def call(gateway: Gateway) -> Refused:
        with pytest.raises(Refused) as caught:
            await gateway.complete(service.principal, body, CHAT)
        return caught.value

    return service.run(call)


def test_refusals_are_typed_errors(service: Service) -> None:
    missing = refusal(service, chat("someone-elses"))
    assert missing.status == 404 and missing.error.code == wire.MODEL_NOT_FOUND
    assert "someone-elses" in missing.error.message
    capped = refusal(service, chat(stop=["x"] * 17))
    assert capped.status == 400 and capped.error.param == "stop"
    assert service.engine.received == []  # neither reached the engine
    assert recorded_usage(service.app, timeout=0) == []  # nor was admitted


@pytest.mark.parametrize(
    ("code", "status", "retry_after", "marked"),
    [(wire.ADAPTER_FAILED, 422, None, "failed"), (wire.ADAPTER_UNAVAILABLE, 503, 5, "ready")],
)
def test_the_engines_verdict_on_an_adapter_is_engine_refused(
    service: Service, code: str, status: int, retry_after: int | None, marked: str
) -> None:
    service.engine.refuse = (400, code, "the weights hold NaN")

    async def call(gateway: Gateway) -> EngineRefused:
        with pytest.raises(EngineRefused) as caught:
            await gateway.complete(service.principal, chat(), CHAT)
        return caught.value

    refused = service.run(call)
    assert (refused.status, refused.retry_after) == (status, retry_after)
    assert refused.error == wire.WireError("the weights hold NaN", wire.INVALID_REQUEST, code)
    assert json.loads(refused.content)["error"]["code"] == code  # the engine's bytes, passed on
    (row,) = recorded_usage(service.app)
    assert row.status == "engine_400"
    assert service.adapter_status() == marked


def test_the_playground_calls_the_service_not_the_route() -> None:
    """The console used to import the route's function and re-parse its Response bytes."""
    import loraplex.web.console.playground as playground

    tree = ast.parse(Path(playground.__file__).read_text())
    imported = {
        node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0
    }
    assert "services.completions" in imported
    assert not any("routes" in module for module in imported)
