"""Admission counts an adapter's pages, against the real engine server with a small pool.

The attack: a request whose KV cache fits the pool, but not beside its adapter. It used to be admitted,
grow until the pool could not hold both, and end in a 500 that took the waiting requests with it. Now
a request that can never fit is a 400 naming max_tokens before it runs, and one that does not fit now
waits its turn; everyone else is served.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.engine.server.conftest import BASE, DEMO_ADAPTER, INTERNAL, TOKEN, Server, running_server

PAGE = 16
NUM_PAGES = 96


@pytest.fixture(scope="module")
def server(engine_factory: Any) -> Iterator[Server]:
    engine = {"num_pages": NUM_PAGES, "page_size": PAGE, "max_num_seqs": 8}
    with running_server(
        engine_factory, engine, internal_token=TOKEN, adapters=[f"uppercase={DEMO_ADAPTER}"]
    ) as shared:
        yield shared


def complete(server: Server, model: str, prompt: list[int], **fields: Any) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "temperature": 0, **fields}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=INTERNAL, timeout=300)


def adapter_pages(server: Server) -> int:
    return server.engine.registry.pages_of("uppercase")


def test_a_request_that_fits_only_without_its_adapter_is_a_400_and_others_are_served(server: Server) -> None:
    usable = NUM_PAGES - 1
    pages = adapter_pages(server)
    assert 1 <= pages < usable // 2, "the test needs an adapter that takes part of the pool"
    # KV for prompt + max_tokens: one page more than what the adapter leaves, well within the pool.
    prompt = [1000 + i for i in range((usable - pages) * PAGE)]
    max_tokens = PAGE
    waiting = [[2000 + i for i in range(12)] for _ in range(4)]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        attack = pool.submit(complete, server, "uppercase", prompt, max_tokens=max_tokens)
        others = [
            pool.submit(complete, server, m, p, max_tokens=4)
            for m, p in zip([BASE, "uppercase"] * 2, waiting, strict=True)
        ]
        refused = attack.result()
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "max_tokens" and f"adapter {pages} more" in error["message"]
        for other in others:
            assert other.result().status_code == 200, other.result().text
    # The same request for the base model alone fits: it is admitted (and here left at once).
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={"model": BASE, "prompt": prompt, "max_tokens": max_tokens, "stream": True},
        headers=INTERNAL,
        timeout=300,
    ) as alone:
        assert alone.status_code == 200
    server.wait_idle()
    assert server.engine.pool.pages_by_kind()["kv"] == 0


def test_without_max_tokens_an_adapter_request_gets_what_the_adapter_leaves(server: Server) -> None:
    """The default max_tokens fills the pool less the adapter's pages, so it is never refused."""
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={"model": "uppercase", "prompt": "Once upon a time", "stream": True, "temperature": 0},
        headers=INTERNAL,
        timeout=300,
    ) as response:
        assert response.status_code == 200, response.read()
    server.wait_idle()


def test_a_request_that_does_not_fit_now_waits_and_then_runs(server: Server) -> None:
    """A long base request holds most of the pool; an adapter request that cannot fit beside it waits
    (no 500, no adapter load in vain) and is served once the pages come back."""
    pages = adapter_pages(server)
    usable = NUM_PAGES - 1
    hog = [3000 + i for i in range((usable - pages) * PAGE - 2 * PAGE)]  # leaves the adapter a page short
    loads_before = server.engine.stats().adapter_loads
    started = threading.Event()
    results: dict[str, httpx.Response] = {}

    def run_hog() -> None:
        started.set()
        results["hog"] = complete(server, BASE, hog, max_tokens=PAGE, ignore_eos=True)

    hog_thread = threading.Thread(target=run_hog)
    hog_thread.start()
    started.wait()
    deadline = time.monotonic() + 60
    # Its full pages pass to the prefix cache (kind "prefix") once filled, still held by the request.
    while sum(server.engine.pool.pages_by_kind()[k] for k in ("kv", "prefix")) < len(hog) // PAGE:
        assert time.monotonic() < deadline, "the long request never took its pages"
        time.sleep(0.01)
    small = complete(server, "uppercase", [4000 + i for i in range(3 * PAGE)], max_tokens=4)
    hog_thread.join(timeout=300)
    assert results["hog"].status_code == 200, results["hog"].text
    assert small.status_code == 200, small.text
    assert small.json()["choices"][0]["text"]
    # Loaded once, when it could run: never into pages the KV cache had to take back at once.
    assert server.engine.stats().adapter_loads - loads_before <= 1
