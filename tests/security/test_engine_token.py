"""With LORAPLEX_INTERNAL_TOKEN set, the engine serves nothing without it but its probes.

On a cluster every engine pod has the token and only the gateway (and the operator's autoscaler) holds
it, so a pod reached directly (another namespace, a port-forward) answers 401 before reading the request;
/health and /ready answer anyone, since kubelet's probes carry no token. /metrics needs the token too
(test_engine_metrics_auth.py).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loraplex.engine.server import trust
from tests.engine.server.conftest import BASE, INTERNAL, TOKEN, Server, running_server

CHAT = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
COMPLETION = {"model": BASE, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
INFERENCE = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", COMPLETION),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
    ("GET", "/openapi.json", None),
    ("GET", "/docs", None),
    ("GET", "/internal/adapters", None),
    ("GET", "/metrics", None),
    ("GET", "/nowhere", None),
]


@pytest.fixture(scope="module")
def server(engine_factory: Any) -> Iterator[Server]:
    engine = {"num_pages": 64, "max_num_seqs": 4}
    with running_server(engine_factory, engine, internal_token=TOKEN) as shared:
        yield shared


def call(server: Server, method: str, path: str, body: Any, headers: dict[str, str]) -> httpx.Response:
    return httpx.request(method, f"{server.url}{path}", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize(("method", "path", "body"), INFERENCE, ids=[f"{m} {p}" for m, p, _ in INFERENCE])
def test_everything_but_probes_needs_the_token(server: Server, method: str, path: str, body: Any) -> None:
    prompts_before = server.sample("loraplex_prompt_tokens_total")
    missing = call(server, method, path, body, {})
    assert missing.status_code == 401, missing.text
    assert missing.json()["error"]["code"] == "missing_internal_token"
    assert "X-Loraplex-Internal-Token" in missing.json()["error"]["message"]
    for wrong in ("", TOKEN + "x", TOKEN[:-1], "x" * 4096, TOKEN.upper()):
        refused = call(server, method, path, body, {"X-Loraplex-Internal-Token": wrong})
        assert refused.status_code == 401, (wrong[:20], refused.text)
    assert server.sample("loraplex_prompt_tokens_total") == prompts_before  # nothing reached the engine
    allowed = call(server, method, path, body, INTERNAL)
    assert allowed.status_code == (404 if path == "/nowhere" else 200), allowed.text


def test_an_invalid_body_without_the_token_is_a_401_not_a_400(server: Server) -> None:
    """The token is checked before the body is looked at, so a stranger learns nothing of the API."""
    response = call(server, "POST", "/v1/completions", {"model": BASE, "prompt": "Hi", "n": 10**6}, {})
    assert response.status_code == 401


@pytest.mark.parametrize("path", ["/health", "/ready"])
def test_probes_stay_open(server: Server, path: str) -> None:
    response = httpx.get(f"{server.url}{path}", timeout=10)
    assert response.status_code == 200, response.text


def test_the_token_is_compared_in_constant_time(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(trust.hmac, "compare_digest", spy)
    assert call(server, "GET", "/v1/models", None, {"X-Loraplex-Internal-Token": "guess"}).status_code == 401
    assert (b"guess", TOKEN.encode()) in compared
