"""The engines' own queues as every control-plane replica reads them (web/services/engine_load.py): the
shared half of the router's load, so two replicas rank pods alike although each counts only its own
requests; and their adapter budgets, which bound what placement assigns each pod."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.utils import floatToGoString

from loraplex import wire
from loraplex.web.services.engine_load import EngineLoadScraper
from loraplex.web.services.routing import Change, PlacementPolicy, Router

TOKEN = "internal-token"
BUSY, IDLE, DOWN = "http://busy:8000", "http://idle:8000", "http://down:8000"


def exposition(waiting: float, running: float, adapter_bytes: int | None = None) -> str:
    text = (
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="m"}} {running}\n'
    )
    if adapter_bytes is not None:  # as the engine's prometheus-client writes it (1e+09 for a GB)
        text += "# TYPE loraplex_adapter_capacity_bytes gauge\n"
        text += f"loraplex_adapter_capacity_bytes {floatToGoString(adapter_bytes)}\n"
    return text


def engines(seen: list[httpx.Request], budgets: dict[str, int] | None = None) -> httpx.MockTransport:
    """BUSY, IDLE and DOWN (503); `budgets`: the adapter bytes a pod reports (none where not given)."""

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.headers.get(wire.INTERNAL_TOKEN_HEADER) != TOKEN:
            return httpx.Response(401)
        pod = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if pod == DOWN:
            return httpx.Response(503)
        budget = (budgets or {}).get(pod)
        return httpx.Response(
            200, text=exposition(6, 10, budget) if pod == BUSY else exposition(0, 1, budget)
        )

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


def replica(
    http: httpx.AsyncClient, pods: Pods | None = None, policy: PlacementPolicy | None = None
) -> tuple[Router, EngineLoadScraper]:
    router = Router(cooldown_s=10.0, discovery=pods or Pods(), policy=policy)  # type: ignore[arg-type]
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


# -- adapter budgets -----------------------------------------------------------------------------------------

SIZE = 30  # adapter bytes, as the gateway passes the stored size to Router.order


def place(router: Router, count: int, first: int = 0) -> dict[str, int]:
    """Ask for `count` adapters of SIZE bytes; the adapters each pod is assigned."""
    for i in range(first, first + count):
        router.order(f"adapter:{i}", DEPLOYMENT, SIZE)
    placement = router.placement(DEPLOYMENT)
    held = {pod: 0 for pod in placement.pods}
    for members in placement.sets().values():
        for pod in members:
            held[pod] += 1
    for pod in placement.pods:
        assert placement.assigned_bytes(pod) == held[pod] * SIZE
    return held


def test_a_pod_reporting_a_small_budget_is_assigned_no_more_adapters_than_fit() -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient(transport=engines([], {BUSY: 100, IDLE: 10_000})) as http:
            router, scraper = replica(http)  # no configured budget: unbounded where nothing is reported
            await scraper.scrape_once()
            held = place(router, 60)
            assert held[BUSY] == 3  # 100 bytes hold three adapters of 30, and it is full
            assert held[IDLE] > 3 and held[BUSY] + held[IDLE] + held[DOWN] == 60  # the rest found room
            placement = router.placement(DEPLOYMENT)
            assert placement.overflows == 0
            assert placement.capacity(BUSY) == 100 and placement.capacity(IDLE) == 10_000

    asyncio.run(scenario())


def test_a_pod_without_the_gauge_falls_back_to_the_setting() -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient(transport=engines([], {BUSY: 10_000})) as http:
            # IDLE answers without a budget, DOWN does not answer: both get pod_adapter_bytes.
            router, scraper = replica(http, policy=PlacementPolicy(pod_adapter_bytes=2 * SIZE))
            await scraper.scrape_once()
            held = place(router, 40)
            assert held[IDLE] == held[DOWN] == 2 and held[BUSY] == 36
            placement = router.placement(DEPLOYMENT)
            assert placement.capacity(IDLE) == placement.capacity(DOWN) == 2 * SIZE
        async with httpx.AsyncClient(transport=engines([])) as http:
            unbounded, scraper = replica(http)  # the setting's default, 0: unbounded
            await scraper.scrape_once()
            assert unbounded.placement(DEPLOYMENT).capacity(IDLE) is None
            assert sum(place(unbounded, 40).values()) == 40

    asyncio.run(scenario())


def test_a_budget_reported_after_adapters_were_placed_re_places_them_within_it() -> None:
    async def scenario() -> None:
        budgets: dict[str, int] = {}
        async with httpx.AsyncClient(transport=engines([], budgets)) as http:
            router, scraper = replica(http)
            changes: list[Change] = []
            router.subscribe(changes.append)
            await scraper.scrape_once()  # no budgets yet: unbounded
            before = place(router, 30)
            assert before[BUSY] > 3
            budgets[BUSY] = 100
            await scraper.scrape_once()
            after = place(router, 0)
            assert after[BUSY] == 3 and sum(after.values()) == 30  # the others moved to pods with room
            moved = [c for c in changes if c.reason == "capacity"]
            assert moved and all(BUSY in c.removed and BUSY not in c.members for c in moved)
            # The same budget again changes nothing; a pod that stops reporting one gets the setting.
            changes.clear()
            await scraper.scrape_once()
            assert not changes
            del budgets[BUSY]
            await scraper.scrape_once()
            assert router.placement(DEPLOYMENT).capacity(BUSY) is None

    asyncio.run(scenario())


def test_a_pod_reporting_no_room_is_assigned_no_adapter() -> None:
    async def scenario() -> None:
        # Its KV headroom takes its whole pool: 0 there is no room, not the setting's "unbounded".
        async with httpx.AsyncClient(transport=engines([], {BUSY: 0, IDLE: 0})) as http:
            router, scraper = replica(http)
            await scraper.scrape_once()
            held = place(router, 10)
            assert held[BUSY] == held[IDLE] == 0 and held[DOWN] == 10

    asyncio.run(scenario())
