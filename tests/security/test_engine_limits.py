"""The engine's request caps (wire/limits.py), each attacked against the real engine server.

A tenant-controlled field whose cost grows with its size is bounded, and a request over a bound is
refused before any work with a 400 naming the field (413 for a body over the size cap, refused unread);
requests at the bound are served. The numbers are the ones the gateway imports.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from loraplex.engine.server.app import BodySizeLimit
from loraplex.wire import limits
from tests.engine.server.conftest import BASE, INTERNAL, TOKEN, Server, running_server

QUESTION = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(engine_factory: Any) -> Iterator[Server]:
    engine = {"num_pages": 128, "max_num_seqs": 8}
    with running_server(engine_factory, engine, internal_token=TOKEN) as shared:
        yield shared


def chat(server: Server, **fields: Any) -> httpx.Response:
    body = {"model": BASE, "messages": QUESTION, "max_tokens": 4, "temperature": 0, **fields}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=INTERNAL, timeout=60)


def complete(server: Server, **fields: Any) -> httpx.Response:
    body = {"model": BASE, "prompt": "Hello", "max_tokens": 4, "temperature": 0, **fields}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=INTERNAL, timeout=60)


def refused(response: httpx.Response, param: str, status: int = 400) -> str:
    """The error's message, after checking the status and that it names `param`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    return str(error["message"])


def prompt_tokens_counted(server: Server) -> float:
    return server.sample("loraplex_prompt_tokens_total")


def test_the_limits_module_needs_nothing_the_gateway_lacks() -> None:
    """The control plane imports it: no torch, no pydantic, no web framework behind it."""
    code = (
        "import sys; import loraplex.wire.limits as l; "
        "heavy = {'torch', 'pydantic', 'fastapi', 'starlette'} & set(sys.modules); "
        "assert not heavy, heavy; print(l.MAX_STOP_SEQUENCES)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(limits.MAX_STOP_SEQUENCES)


def test_a_700k_entry_stop_list_is_refused_unread(server: Server) -> None:
    """The attack that slowed every tenant's stream 2.6x: 7.6 MB of stop strings. Its Content-Length
    alone gets a 413; the server answers before a byte of the body is sent."""
    body = json.dumps({"model": BASE, "prompt": "Hi", "stop": [f"s{i}" for i in range(700_000)]}).encode()
    assert len(body) > 7_000_000
    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as conn:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
            f"X-Loraplex-Internal-Token: {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        conn.sendall(head.encode())
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            piece = conn.recv(65536)
            if not piece:
                break
            reply += piece
    status_line, _, rest = reply.partition(b"\r\n")
    assert b" 413 " in status_line, reply[:300]
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_too_large" and error["param"] == "body"
    assert str(limits.MAX_REQUEST_BODY_BYTES) in error["message"]


def test_stop_lists_within_the_body_cap_are_capped_by_count_and_length(server: Server) -> None:
    many = [f"s{i}" for i in range(100_000)]  # 0.9 MB: under the body cap, far over the count cap
    message = refused(complete(server, stop=many), "stop")
    assert "100000 sequences" in message and str(limits.MAX_STOP_SEQUENCES) in message
    refused(complete(server, stop=["x"] * (limits.MAX_STOP_SEQUENCES + 1)), "stop")
    long = refused(complete(server, stop="y" * (limits.MAX_STOP_CHARS + 1)), "stop")
    assert str(limits.MAX_STOP_CHARS) in long
    refused(chat(server, stop=["ok", "z" * (limits.MAX_STOP_CHARS + 1)]), "stop")
    # At the bounds, served.
    at_bound = [chr(0x4E00 + i) * limits.MAX_STOP_CHARS for i in range(limits.MAX_STOP_SEQUENCES)]
    assert complete(server, stop=at_bound).status_code == 200


@pytest.mark.parametrize(
    "bias",
    [
        {str(i): 1 for i in range(limits.MAX_LOGIT_BIAS_ENTRIES + 1)},
        {"42": 1e9},
        {"42": -101},
        {"not-a-token": 1},
        {"9" * 5000: 1},
        {"42": "5"},
    ],
    ids=["too-many", "huge", "below-range", "not-a-token", "5000-digits", "string-value"],
)
def test_logit_bias_entries_and_values_are_capped(server: Server, bias: dict[str, Any]) -> None:
    refused(complete(server, logit_bias=bias), "logit_bias")


def test_logit_bias_nan_is_refused(server: Server) -> None:
    # Python's JSON parser (the server's) takes NaN; json.dumps writes it the same way.
    raw = json.dumps({"model": BASE, "prompt": "Hi", "max_tokens": 2, "logit_bias": {"42": float("nan")}})
    assert "NaN" in raw
    response = httpx.post(
        f"{server.url}/v1/completions",
        content=raw,
        headers={**INTERNAL, "Content-Type": "application/json"},
        timeout=30,
    )
    assert "between" in refused(response, "logit_bias")


@pytest.mark.parametrize("n", [0, limits.MAX_CHOICES + 1, 10**6])
def test_n_is_capped(server: Server, n: int) -> None:
    refused(chat(server, n=n), "n")


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_is_capped_whatever_the_context(server: Server, field: str) -> None:
    refused(chat(server, **{field: limits.MAX_COMPLETION_TOKENS + 1}), field)
    refused(chat(server, **{field: 10**30}), field)


def test_prompts_are_capped_before_they_are_tokenized(server: Server) -> None:
    before = prompt_tokens_counted(server)
    refused(complete(server, prompt="a" * (limits.MAX_PROMPT_CHARS + 1)), "prompt")
    refused(complete(server, prompt=[1] * (limits.MAX_PROMPT_TOKENS + 1)), "prompt")
    refused(complete(server, prompt=[[1] * (limits.MAX_PROMPT_TOKENS + 1)]), "prompt")
    messages = [{"role": "user", "content": "hi"}] * (limits.MAX_CHAT_MESSAGES + 1)
    refused(chat(server, messages=messages), "messages")
    half = "b" * (limits.MAX_PROMPT_CHARS // 2 + 1)
    parts = [{"type": "text", "text": half}]
    refused(
        chat(server, messages=[{"role": "user", "content": half}, {"role": "user", "content": parts}]),
        "messages",
    )
    assert prompt_tokens_counted(server) == before  # none of them reached the engine


def test_a_prompt_within_the_caps_still_meets_the_context(server: Server) -> None:
    response = complete(server, prompt=[1] * 9000)  # under MAX_PROMPT_TOKENS, over SmolLM2's 8192
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


def test_a_chunked_body_over_the_cap_is_refused_while_reading() -> None:
    """Without a Content-Length the middleware counts what arrives and stops at the cap, holding at most
    the cap in memory; the app behind it is never called."""
    called: list[bool] = []
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        called.append(True)

    chunk = b"x" * 65536
    pieces = (limits.MAX_REQUEST_BODY_BYTES // len(chunk)) + 4
    reads = [0]

    async def receive() -> dict[str, Any]:
        reads[0] += 1
        return {"type": "http.request", "body": chunk, "more_body": reads[0] < pieces}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
    asyncio.run(BodySizeLimit(app, limits.MAX_REQUEST_BODY_BYTES)(scope, receive, send))
    assert not called
    assert sent[0]["status"] == 413
    assert reads[0] == limits.MAX_REQUEST_BODY_BYTES // len(chunk) + 1  # stopped at the first chunk over

    # Under the cap, the app gets the whole body, replayed.
    bodies: list[bytes] = []

    async def echo(scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        bodies.append(body)

    reads[0], pieces = 0, 3
    asyncio.run(BodySizeLimit(echo, limits.MAX_REQUEST_BODY_BYTES)(scope, receive, send))
    assert bodies == [chunk * 3]


def test_a_tiny_temperature_is_greedy_not_an_overflow(server: Server) -> None:
    """logits / 1e-300 overflow to infinity and sampling from them raises, which failed the step of
    every tenant in the batch: below limits.MIN_SAMPLING_TEMPERATURE sampling is greedy."""
    greedy = chat(server, max_tokens=8, temperature=0)
    tiny = chat(server, max_tokens=8, temperature=1e-300)
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["message"] == greedy.json()["choices"][0]["message"]
