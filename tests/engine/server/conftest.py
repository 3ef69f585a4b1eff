"""Engine servers on real sockets: uvicorn in a thread, SmolLM2 loaded once per session and shared.

`server` is the one most tests use (an internal token, the demo adapter registered as `uppercase`);
`make_server` builds others with different limits on the same loaded weights (each with its own pool).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from loraplex.engine.engine import LLMEngine
from loraplex.engine.server.app import ServerState, create_app
from loraplex.engine.server.settings import ServerSettings

REPO = Path(__file__).resolve().parents[3]
DEMO_ADAPTER = REPO / "fixtures" / "adapters" / "demo-uppercase"
BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOKEN = "internal-test-token"
INTERNAL = {"X-Loraplex-Internal-Token": TOKEN}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    state: ServerState

    @property
    def engine(self) -> LLMEngine:
        """The engine itself, for checks after the loop has gone idle (it is not thread-safe)."""
        assert self.state.engine is not None
        return self.state.engine.engine

    def metrics(self) -> str:
        """/metrics as the operator reads it: with the internal token (a server without one ignores it)."""
        response = httpx.get(f"{self.url}/metrics", headers=INTERNAL, timeout=10)
        assert response.status_code == 200, response.text
        return response.text

    def sample(self, name: str, labels: str = "") -> float:
        """One sample's value from /metrics, e.g. sample("loraplex_pool_pages", 'kind="kv"')."""
        wanted = f"{name}{{{labels}}}" if labels else name
        for line in self.metrics().splitlines():
            if line.startswith(wanted + " "):
                return float(line.split()[-1])
        raise AssertionError(f"{wanted} is not in /metrics")

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Until the engine has no request left and the loop has published that (it does when idle)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            engine = self.state.engine
            idle = engine is not None and engine.waiting == 0 and engine.running == 0
            if (
                idle
                and self.sample("loraplex_requests_running") == self.sample("loraplex_requests_waiting") == 0
            ):
                return
            time.sleep(0.05)
        raise AssertionError("the engine did not go idle")


@contextmanager
def serving(app: Any, ready_timeout_s: float = 120.0, wait_ready: bool = True) -> Iterator[str]:
    """Run `app` under uvicorn in a thread until it answers /ready (or only until it listens, without
    `wait_ready`); yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout_s
    try:
        while True:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("test server did not become ready")
            if server.started and not wait_ready:
                break
            if server.started:
                try:
                    if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


ServerFactory = Callable[..., Any]


@contextmanager
def running_server(
    engine_factory: Callable[..., Callable[[], LLMEngine]],
    engine: dict[str, Any] | None = None,
    **settings: Any,
) -> Iterator[Server]:
    """A server with these settings on an engine with these EngineConfig overrides, until exit."""
    app = create_app(ServerSettings(**settings), engine_factory(**(engine or {})))
    with serving(app) as url:
        yield Server(url, app.state.server)


@pytest.fixture
def make_server(engine_factory: Callable[..., Callable[[], LLMEngine]]) -> Iterator[ServerFactory]:
    """make_server(settings overrides..., engine=dict(EngineConfig overrides)) -> a running Server,
    stopped (and its pool freed) when the test ends. Its internal token is TOKEN unless overridden."""
    with ExitStack() as stack:
        yield lambda engine=None, **settings: stack.enter_context(
            running_server(engine_factory, engine, **{"internal_token": TOKEN, **settings})
        )


@pytest.fixture(scope="session")
def server(engine_factory: Callable[..., Callable[[], LLMEngine]]) -> Iterator[Server]:
    """The shared server: internal token set, the demo adapter registered as `uppercase`."""
    with running_server(
        engine_factory, internal_token=TOKEN, adapters=[f"uppercase={DEMO_ADAPTER}"], max_queue=64
    ) as shared:
        yield shared
