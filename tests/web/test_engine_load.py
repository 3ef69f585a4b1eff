"""The engines' own queues as every control-plane replica reads them (web/services/engine_load.py): the
shared half of the router's load, so two replicas rank pods alike although each counts only its own
requests."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from loraplex import wire
from loraplex.web.services.engine_load import EngineLoadScraper
from loraplex.web.services.routing import Router

TOKEN = "internal-token"
BUSY, IDLE, DOWN = "http://busy:8000", "http://idle:8000", "http://down:8000"


def exposition(waiting: float, running: float) -> str:
    return (
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="m"}} {running}\n'
    )


def engines(seen: list[httpx.Request]) -> httpx.MockTransport:
    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.headers.get(wire.INTERNAL_TOKEN_HEADER) != TOKEN:
            return httpx.Response(401)
        pod = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if pod == DOWN:
            return httpx.Response(503)
        return httpx.Response(200, text=exposition(6, 10) if pod == BUSY else exposition(0, 1))

    return httpx.MockTransport(answer)


class Pods:
    """Discovery of one kubernetes:// deployment, its pods as set by the test."""

    def __init__(self) -> None:
        self.now = [BUSY, IDLE, DOWN]

    def expand(self, endpoints: list[str]) -> list[str]:
        return list(self.now)

    def leaving(self, endpoints: list[str]) -> list[str]:
        return []


DEPLOYMENT = ["kubernetes://ns/llama"]


def replica(http: httpx.AsyncClient, pods: Pods | None = None) -> tuple[Router, EngineLoadScraper]:
    router = Router(cooldown_s=10.0, discovery=pods or Pods())  # type: ignore[arg-type]
    router.order(None, DEPLOYMENT)  # the deployment is routed: its pods are known
    return router, EngineLoadScraper(http, TOKEN, router, interval_s=1.0)


def test_each_pod_load_is_the_larger_of_the_engine_queue_and_the_own_count() -> None:
    async def scenario() -> None:
        seen: list[httpx.Request] = []
        async with httpx.AsyncClient(transport=engines(seen)) as http:
            router, scraper = replica(http)
            await scraper.scrape_once()
            assert {r.url.path for r in seen} == {"/metrics"} and len(seen) == 3
            assert router.load.load(BUSY) == 16 and router.load.load(IDLE) == 1
            assert router.load.load(DOWN) == 0 and scraper.failures == 1
            mine = [router.begin(IDLE, None) for _ in range(4)]  # sent since the last read: counted at once
            assert router.load.load(IDLE) == 4
            for work in mine:
                work.done()
            assert router.load.load(IDLE) == 1

    asyncio.run(scenario())


def test_two_replicas_rank_pods_alike_though_only_one_sent_the_traffic() -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient(transport=engines([])) as http:
            first, first_scraper = replica(http)
            second, second_scraper = replica(http)
            for _ in range(16):  # the first replica's own flood, all on BUSY
                first.begin(BUSY, None)
            await asyncio.gather(first_scraper.scrape_once(), second_scraper.scrape_once())
            # The second replica sent nothing, yet it too sends base traffic to the idle pods first.
            for router in (first, second):
                assert router.order(None, DEPLOYMENT)[-1] == BUSY

    asyncio.run(scenario())


def test_a_pod_that_leaves_is_forgotten_and_the_loop_runs_until_stopped() -> None:
    async def scenario() -> None:
        seen: list[httpx.Request] = []
        async with httpx.AsyncClient(transport=engines(seen)) as http:
            pods = Pods()
            router, scraper = replica(http, pods)
            scraper.interval_s = 0.01
            scraper.start()
            await asyncio.sleep(0.2)
            await scraper.stop()
            reads = len(seen)
            assert reads >= 6  # several rounds over the three pods
            await asyncio.sleep(0.05)
            assert len(seen) == reads  # stopped
            pods.now = [IDLE]  # BUSY and DOWN left the deployment
            router.order(None, DEPLOYMENT)
            await scraper.scrape_once()
            assert router.load.load(BUSY) == 0 and router.load.load(IDLE) == 1

    asyncio.run(scenario())


def test_a_wrong_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        EngineLoadScraper(httpx.AsyncClient(), TOKEN, Router(cooldown_s=1.0), interval_s=0)
