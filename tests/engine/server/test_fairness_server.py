"""Tenant fairness through `loraplex serve`: the gateway's tenant and weight headers reach the engine's
virtual token counters, and a tenant arriving behind another's queue is served before that queue (fair)
or after it (fcfs). Order, not wall time, is asserted: the host is shared; the times are printed."""

from __future__ import annotations

import asyncio
import time

import httpx

from loraplex import wire
from loraplex.engine.fairness import FairQueue

from .conftest import TOKEN, ServerFactory


def headers(tenant: str, weight: float = 1.0) -> dict[str, str]:
    return wire.request_headers(TOKEN, wire.TenantRef(tenant, weight))


def test_the_weight_header_divides_the_tenants_counter(make_server: ServerFactory) -> None:
    server = make_server()
    body = {"model": "base", "prompt": [100] * 10, "max_tokens": 3, "ignore_eos": True}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers("w", 4.0), timeout=60)
    assert answer.status_code == 200, answer.text
    server.wait_idle()
    queue = server.engine.scheduler.queue
    assert isinstance(queue, FairQueue)
    assert queue.vtc.counter("w") == (1.0 * 10 + 2.0 * 3) / 4.0  # w_p 1, w_q 2, weight 4


def test_a_bad_weight_header_is_refused(make_server: ServerFactory) -> None:
    server = make_server()
    body = {"model": "base", "prompt": [100] * 4, "max_tokens": 1}
    for bad in ("0", "-1", "nan", "inf", "two"):
        sent = {**headers("w"), wire.TENANT_WEIGHT_HEADER: bad}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, headers=sent, timeout=60)
        assert answer.status_code == 400, (bad, answer.text)
        assert wire.TENANT_WEIGHT_HEADER in answer.json()["error"]["message"]


async def first_tokens(url: str, a_requests: int, wait_queued) -> tuple[list[float], float]:
    """A sends `a_requests` at once; once they are queued, B sends one. Returns when each A request and
    B's got their first token (seconds from B's send)."""

    async def stream(client: httpx.AsyncClient, tenant: str, prompt: list[int], tokens: int) -> float:
        body = {"model": "base", "prompt": prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers(tenant)) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return time.perf_counter()
        raise AssertionError("no token streamed")

    async with httpx.AsyncClient(timeout=300) as client:
        a = [asyncio.create_task(stream(client, "A", [200 + i] * 24, 8)) for i in range(a_requests)]
        await asyncio.to_thread(wait_queued)
        sent = time.perf_counter()
        b = await stream(client, "B", [300] * 4, 2)
        a_first = await asyncio.gather(*a)
    return [t - sent for t in a_first], b - sent


def test_a_tenant_behind_a_flood_goes_first_with_fair_and_last_with_fcfs(make_server: ServerFactory) -> None:
    results = {}
    for scheduling in ("fcfs", "fair"):
        server = make_server(engine={"scheduling": scheduling, "max_num_seqs": 2})

        def queued(server=server) -> None:
            deadline = time.monotonic() + 60
            while server.state.engine is None or server.state.engine.waiting < 4:
                assert time.monotonic() < deadline, "A's requests were not queued"
                time.sleep(0.01)

        results[scheduling] = asyncio.run(first_tokens(server.url, 6, queued))
    a_fcfs, b_fcfs = results["fcfs"]
    a_fair, b_fair = results["fair"]
    print(f"B's TTFT behind 6 of A's: fcfs {b_fcfs * 1000:.0f} ms, fair {b_fair * 1000:.0f} ms")
    assert all(t < b_fcfs for t in a_fcfs)  # FCFS: every A request queued before B went first
    # fair: B went before A's queue. 4 of A's were waiting when B was sent; under load one batch of A's may
    # finish and 2 more start before B's request reaches the engine, so at least 2 must still follow B.
    assert sum(t > b_fair for t in a_fair) >= 2
