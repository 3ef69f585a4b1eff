"""Issue 29 item 2: no tenant's flood refuses another tenant. The attack: while tenant A held an engine's
waiting queue, tenant B got `429 queue_full`; tenant quotas had no in-flight cap; the gateway's upstream
connections were one pool for all.

Now (docs/security.md, "Shares of queues and connections"): the engine gives each tenant a share of its
waiting queue and keeps the last part of it for tenants below their floor (wire/shares.py); the gateway
caps each tenant's and each API key's requests in flight and shares its upstream connections by the same
rule (web/services/in_flight.py). A tenant over its share or cap gets a 429 naming it; the others do not.

The engines here are a tiny random model whose steps are held (they do nothing until released), so every
admitted request stays in the waiting queue: the queue's fill is the test's alone, with no timing in it.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex import wire
from loraplex.engine import EngineConfig, LLMEngine
from loraplex.engine.request import RequestOutput
from loraplex.engine.server.app import ServerState
from loraplex.engine.server.app import create_app as create_engine_app
from loraplex.engine.server.settings import ServerSettings
from loraplex.web.db.models import UserRole
from loraplex.web.services.in_flight import Busy, InFlight
from loraplex.web.services.keys import Principal
from loraplex.wire.shares import Holdings, Shares
from tests.engine.server.conftest import serving
from tests.web.conftest import (  # noqa: F401  (fixtures)
    ADMIN,
    SHAPE,
    Api,
    app_factory,
    sqlite_template,
    sqlite_url,
)
from tests.web.console_client import make_user, post_form, sign_in
from tests.web.servers import serve

pytestmark = pytest.mark.timeout(120)
TOKEN = "internal-test-token"  # the web tests' settings give the gateway this one
MODEL = "tiny-llama"
DEADLINE_S = 30.0  # a bound on waiting for what must happen, never a wait that makes a test pass

# -- the rule ------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(1, 40),
    floor=st.integers(0, 10),
    reserve_fraction=st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.9]),
    moves=st.lists(st.tuples(st.integers(0, 4), st.booleans()), max_size=200),
)
def test_no_tenant_passes_its_bound_and_one_flooder_never_keeps_a_tenant_below_its_floor_out(
    capacity: int, floor: int, reserve_fraction: float, moves: list[tuple[int, bool]]
) -> None:
    """Any sequence of tenants asking for and giving back places: nobody is admitted past
    capacity - reserve, the whole is never past capacity, and a tenant below its floor is admitted
    whenever, but for one tenant, the tenants together hold fewer than the reserve."""
    shares = Shares.of(capacity, floor, reserve_fraction)
    held = Holdings()
    for tenant, asks in moves:
        if not asks:
            if held.held(tenant):
                held.give(tenant)
            continue
        refusal = held.refusal(shares, tenant)
        mine = held.held(tenant)
        biggest_other = max((n for t, n in held.counts.items() if t != tenant), default=0)
        if mine < shares.floor and held.total - biggest_other < shares.reserve:
            assert refusal is None, (held.counts, tenant, shares)
        if refusal is None:
            held.take(tenant)
        else:
            assert refusal.code in (wire.QUEUE_FULL, wire.TENANT_SHARE_EXCEEDED)
            assert (refusal.code == wire.QUEUE_FULL) == (held.total >= capacity)
        assert held.total <= capacity
        assert all(n <= max(shares.floor, capacity - shares.reserve) for n in held.counts.values())


def test_shares_refuse_settings_that_break_the_guarantee() -> None:
    with pytest.raises(ValueError, match="floor must be at most"):
        Shares(capacity=8, floor=7, reserve=2)
    with pytest.raises(ValueError, match="reserve"):
        Shares(capacity=8, floor=1, reserve=8)
    with pytest.raises(ValueError, match="reserve_fraction"):
        Shares.of(8, 1, float("nan"))
    assert Shares.of(1, 4, 0.25) == Shares(1, 1, 0)  # a queue of one: no reserve, a floor of one


# -- the engine: each tenant's share of the waiting queue ------------------------------------------------


def tiny_engine() -> LLMEngine:
    """A random model without a tokenizer (prompts are token ids): the engine's own tests."""
    return LLMEngine(EngineConfig(model="random:tiny", device="cpu", num_pages=64, max_num_seqs=2))


class HeldSteps:
    """Engines (from `make`) whose steps do nothing until `released` is set: requests stay waiting."""

    def __init__(self, make: Callable[[], LLMEngine]) -> None:
        self.make = make
        self.released = threading.Event()

    def factory(self) -> LLMEngine:
        engine = self.make()
        step = engine.step

        def held_step() -> list[RequestOutput]:
            if self.released.is_set():
                return step()
            time.sleep(0.002)  # the loop steps again at once: this keeps it off the CPU
            return []

        engine.step = held_step  # type: ignore[method-assign]
        return engine


@contextmanager
def held_engine(
    make: Callable[[], LLMEngine] = tiny_engine, **settings: Any
) -> Iterator[tuple[str, ServerState, HeldSteps]]:
    held = HeldSteps(make)
    app = create_engine_app(
        ServerSettings(internal_token=TOKEN, served_model_name=MODEL, **settings), held.factory
    )
    try:
        with serving(app) as url:
            yield url, app.state.server, held
    finally:
        held.released.set()  # whatever still waits finishes before the server stops


def queued(state: ServerState) -> int:
    """Requests the engine holds in its waiting queue (as its loop published after the last step)."""
    assert state.engine is not None
    return state.engine.waiting


async def settle(tasks: list[asyncio.Task[httpx.Response]], state: ServerState, waiting: int) -> None:
    """Until every task has either been answered or is waiting in the engine's queue: `waiting` in all,
    from this engine's queue before they were sent."""
    deadline = time.monotonic() + DEADLINE_S
    while sum(t.done() for t in tasks) + queued(state) - waiting < len(tasks):
        assert time.monotonic() < deadline, "requests neither answered nor queued"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # one more publish: a refusal races no admission


def answered(tasks: list[asyncio.Task[httpx.Response]]) -> list[httpx.Response]:
    return [t.result() for t in tasks if t.done()]


def assert_refused(response: httpx.Response, code: str, words: str) -> None:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["type"] == wire.RATE_LIMITED and error["code"] == code, error
    assert words in error["message"], error["message"]
    assert response.headers["retry-after"]


class Traffic:
    """Completions sent as tasks on one client, all kept: `finish` releases the engine and awaits every
    one, so however a test ends no request is left behind (and the servers can stop)."""

    def __init__(self, client: httpx.AsyncClient, held: HeldSteps):
        self.client, self.held = client, held
        self.tasks: list[asyncio.Task[httpx.Response]] = []

    def send(
        self, n: int, headers: dict[str, str], body: dict[str, Any]
    ) -> list[asyncio.Task[httpx.Response]]:
        sent = [
            asyncio.ensure_future(self.client.post("/v1/completions", json=body, headers=headers))
            for _ in range(n)
        ]
        self.tasks += sent
        return sent

    async def finish(self) -> list[int]:
        """The status of every request sent (a request that failed outright fails here)."""
        self.held.released.set()
        answers = await asyncio.gather(*self.tasks, return_exceptions=True)
        return sorted(a.status_code if isinstance(a, httpx.Response) else -1 for a in answers)


def run(url: str, held: HeldSteps, scenario: Callable[[Traffic], Awaitable[None]]) -> list[int]:
    """`scenario` on a client of `url`; then every request it sent, answered: their statuses, sorted."""

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_S * 2) as client:
            traffic = Traffic(client, held)
            try:
                await scenario(traffic)
            finally:
                statuses = await traffic.finish()
            return statuses

    return asyncio.run(main())


TOKEN_PROMPT = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}  # the tiny engine has no tokenizer


def tenant(name: str) -> dict[str, str]:
    return {wire.INTERNAL_TOKEN_HEADER: TOKEN, wire.TENANT_HEADER: name}


def test_a_flooding_tenant_is_refused_its_excess_and_the_others_are_admitted() -> None:
    """A queue of 16 with a floor of 2 and 4 places reserved: A alone may hold 12; A's 16 at once get 12
    places and 4 refusals naming its share. B and C, below their floors, are admitted beside it (on the
    old code A's 16 filled the queue and B got `queue_full`)."""
    with held_engine(max_queue=16, queue_tenant_floor=2, queue_reserve_fraction=0.25) as (url, state, held):

        async def scenario(traffic: Traffic) -> None:
            flood = traffic.send(16, tenant("tenant-a"), TOKEN_PROMPT)
            await settle(flood, state, 0)
            refused = answered(flood)
            assert queued(state) == 12 and len(refused) == 4, [r.text for r in refused]
            for response in refused:
                assert_refused(response, wire.TENANT_SHARE_EXCEEDED, "this tenant already holds 12")

            others = traffic.send(2, tenant("tenant-b"), TOKEN_PROMPT)
            others += traffic.send(1, tenant("tenant-c"), TOKEN_PROMPT)
            await settle(others, state, 12)
            assert answered(others) == [] and queued(state) == 15, [r.text for r in answered(others)]
            # B past its floor, with the last places kept for tenants below theirs: refused, naming why.
            beyond = traffic.send(1, tenant("tenant-b"), TOKEN_PROMPT)
            await settle(beyond, state, 15)
            assert_refused(answered(beyond)[0], wire.TENANT_SHARE_EXCEEDED, "kept for tenants below")

        assert run(url, held, scenario) == [200] * 15 + [429] * 5
        scrape = {wire.INTERNAL_TOKEN_HEADER: TOKEN, "Authorization": f"Bearer {TOKEN}"}
        metrics = httpx.get(f"{url}/metrics", headers=scrape, timeout=DEADLINE_S).text
        assert 'loraplex_requests_rejected_total{reason="tenant_share"} 5.0' in metrics


def test_without_tenants_the_queue_is_one_tenants_and_the_full_queue_is_still_queue_full() -> None:
    """Requests without a tenant header are the one anonymous tenant: `loraplex serve` alone keeps its
    whole queue less the reserve, and a queue of one still answers `queue_full` as before."""
    with held_engine(max_queue=1) as (url, state, held):

        async def scenario(traffic: Traffic) -> None:
            anonymous = {wire.INTERNAL_TOKEN_HEADER: TOKEN}
            await settle(traffic.send(1, anonymous, TOKEN_PROMPT), state, 0)
            second = traffic.send(1, anonymous, TOKEN_PROMPT)
            await settle(second, state, 1)
            assert_refused(answered(second)[0], wire.QUEUE_FULL, "limit is 1")

        assert run(url, held, scenario) == [200, 429]


# -- the gateway: caps in flight per tenant and key, shares of the upstream connections ------------------


def principal(tenant: uuid.UUID, key: uuid.UUID | None = None) -> Principal:
    return Principal(tenant, "t", key)


def test_in_flight_caps_per_key_and_tenant_and_a_tenants_own_cap() -> None:
    flights = InFlight.made(tenant_cap=4, key_cap=3, connections=512, floor=16, reserve_fraction=0.25)
    a, b = uuid.uuid4(), uuid.uuid4()
    key1, key2, key_b = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    tickets = [flights.enter(principal(a, key1)) for _ in range(3)]
    with pytest.raises(Busy, match="this API key has 3 requests in flight") as refused:
        flights.enter(principal(a, key1))
    assert (
        refused.value.error.code == wire.TOO_MANY_IN_FLIGHT and refused.value.error.type == wire.RATE_LIMITED
    )
    tickets.append(flights.enter(principal(a, key2)))  # another key of A: the tenant's fourth
    with pytest.raises(Busy, match="this tenant has 4 requests in flight, its limit is 4"):
        flights.enter(principal(a, key2))
    others = [flights.enter(principal(b, key_b)) for _ in range(3)]  # B is untouched by A's caps
    assert flights.held(principal(b, key_b)) == (3, 3)
    tickets[0].release()
    tickets[0].release()  # a second release gives nothing back twice
    assert flights.held(principal(a, key1)) == (3, 2)
    tickets.append(flights.enter(principal(a, key1)))
    # The tenant's own cap (its quota's max_in_flight) replaces the default, both ways.
    assert flights.enter(principal(b), tenant_cap=10) is not None
    with pytest.raises(Busy, match="allows no requests in flight"):
        flights.enter(principal(uuid.uuid4()), tenant_cap=0)
    for ticket in tickets + others:
        ticket.release()


def test_upstream_connections_are_shared_and_a_newcomer_finds_its_floor() -> None:
    """32 connections, a floor of 2, 8 reserved: a tenant with a large cap takes at most 24 alone, and
    four newcomers each find their floor of 2 however A floods; the whole is full only then."""
    flights = InFlight.made(tenant_cap=1000, key_cap=1000, connections=32, floor=2, reserve_fraction=0.25)
    a = uuid.uuid4()
    flood = []
    for _ in range(40):
        try:
            flood.append(flights.enter(principal(a)))
        except Busy as exc:
            assert exc.error.code == wire.TENANT_SHARE_EXCEEDED
            assert "of this gateway's upstream connections" in exc.error.message
    assert len(flood) == 24
    newcomers = [uuid.uuid4() for _ in range(4)]
    for tenant in newcomers:
        for _ in range(2):
            flights.enter(principal(tenant))
    with pytest.raises(Busy, match="all 32 of this gateway's upstream connections are taken") as full:
        flights.enter(principal(uuid.uuid4()))
    assert full.value.error.code == wire.QUEUE_FULL


@dataclass
class Platform:
    gateway: str
    engine: ServerState
    held: HeldSteps
    api: Api


@pytest.fixture
def platform(
    sqlite_url: str,  # noqa: F811
    app_factory: Callable[..., FastAPI],  # noqa: F811
    engine_factory: Callable[..., Callable[[], LLMEngine]],
) -> Iterator[Platform]:
    """A gateway (tenant cap 4, key cap 3) in front of a held engine whose queue of 16 A could fill (on
    SmolLM2's weights: the gateway sends text)."""
    with ExitStack() as stack:
        url, state, held = stack.enter_context(
            held_engine(
                engine_factory(num_pages=64, max_num_seqs=2),
                max_queue=16,
                queue_tenant_floor=2,
                queue_reserve_fraction=0.25,
            )
        )
        caps = {"tenant_max_in_flight": 4, "key_max_in_flight": 3, "engine_read_timeout_s": DEADLINE_S * 2}
        gateway = stack.enter_context(serve(app_factory(sqlite_url, **caps)))
        admin = stack.enter_context(TestClient(app_factory(sqlite_url)))
        api = Api(admin)
        api.deployment("tiny", MODEL, [url], shape=SHAPE)
        yield Platform(gateway, state, held, api)


TEXT_PROMPT = {"model": MODEL, "prompt": "hello", "max_tokens": 2}


def test_a_flood_through_the_gateway_never_refuses_another_tenant_within_its_caps(platform: Platform) -> None:
    """A sends 20 at once on one key: 3 go through (its key's cap), 17 are refused at the gateway naming
    the key's cap; its second key brings it to the tenant's cap of 4. B's 3 (its key's cap) are all
    admitted. On the old code A's 20 reached the engine, filled its queue, and B got `queue_full`."""
    tenant_a, headers_a1 = platform.api.tenant_with_key("flooder")
    headers_a2 = {"Authorization": f"Bearer {platform.api.key(tenant_a['id'], 'second')}"}
    _, headers_b = platform.api.tenant_with_key("victim")
    engine = platform.engine

    async def scenario(traffic: Traffic) -> None:
        flood = traffic.send(20, headers_a1, TEXT_PROMPT)
        await settle(flood, engine, 0)
        assert queued(engine) == 3 and len(answered(flood)) == 17
        for response in answered(flood):
            assert_refused(response, wire.TOO_MANY_IN_FLIGHT, "this API key has 3 requests in flight")

        second_key = traffic.send(2, headers_a2, TEXT_PROMPT)
        await settle(second_key, engine, 3)
        assert queued(engine) == 4
        assert_refused(answered(second_key)[0], wire.TOO_MANY_IN_FLIGHT, "its limit is 4")

        victim = traffic.send(3, headers_b, TEXT_PROMPT)
        await settle(victim, engine, 4)
        assert answered(victim) == [] and queued(engine) == 7, [r.text for r in answered(victim)]

    assert run(platform.gateway, platform.held, scenario) == [200] * 7 + [429] * 18


def test_an_admin_sets_a_tenants_own_cap(platform: Platform) -> None:
    small, headers = platform.api.tenant_with_key("small")
    client = platform.api.client
    url = f"/admin/v1/tenants/{small['id']}/quota"
    for bad in (-1, "many", 2**31):
        assert client.put(url, json={"max_in_flight": bad}, headers=ADMIN).status_code == 422, bad
    quota = client.put(url, json={"max_in_flight": 1}, headers=ADMIN)
    assert quota.status_code == 200 and quota.json()["max_in_flight"] == 1

    async def scenario(traffic: Traffic) -> None:
        await settle(traffic.send(1, headers, TEXT_PROMPT), platform.engine, 0)
        second = traffic.send(1, headers, TEXT_PROMPT)
        await settle(second, platform.engine, 1)
        assert_refused(answered(second)[0], wire.TOO_MANY_IN_FLIGHT, "its limit is 1 (max_in_flight)")

    assert run(platform.gateway, platform.held, scenario) == [200, 429]
    # The place is given back when the request ends: the next one is admitted.
    again = httpx.post(f"{platform.gateway}/v1/completions", json=TEXT_PROMPT, headers=headers, timeout=60)
    assert again.status_code == 200, again.text


def test_the_consoles_quota_form_keeps_the_cap_it_does_not_show(
    sqlite_url: str,  # noqa: F811
    app_factory: Callable[..., FastAPI],  # noqa: F811
) -> None:
    """The console's quota form has no max_in_flight field: saving it keeps the admin API's value (a
    form that reset it would quietly put the tenant back on the default)."""
    app = app_factory(sqlite_url)
    make_user(app, "root@platform.test", role=UserRole.ADMIN)
    with TestClient(app) as admin:
        made = Api(admin).tenant("capped")
        url = f"/admin/v1/tenants/{made['id']}"
        assert admin.put(f"{url}/quota", json={"max_in_flight": 5}, headers=ADMIN).status_code == 200
        sign_in(admin, "root@platform.test")
        page = f"/console/admin/tenants/{made['id']}"
        saved = post_form(admin, page, f"{page}/quota", {"requests_per_minute": "60"})
        assert "Quota saved." in saved.text
        quota = admin.get(url, headers=ADMIN).json()["quota"]
        assert quota["requests_per_minute"] == 60 and quota["max_in_flight"] == 5
