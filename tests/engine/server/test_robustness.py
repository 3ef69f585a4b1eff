"""Clients that hang up, a full queue, steps that raise, a loop that dies, probes while loading."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from loraplex.engine.engine import LLMEngine
from loraplex.engine.server.app import create_app
from loraplex.engine.server.settings import ServerSettings

from .conftest import BASE, INTERNAL, Server, ServerFactory, serving

QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Tell me a long story about a lighthouse keeper."}
]
NO_EOS = {"ignore_eos": True}


def kv_pages(server: Server) -> float:
    return server.sample("loraplex_pool_pages", 'kind="kv"')


def test_32_streams_with_a_third_hanging_up(server: Server) -> None:
    """The ones that stay get every token; the ones that leave are aborted; no KV page is left."""
    clients, leavers, max_tokens = 32, {i for i in range(32) if i % 3 == 0}, 40
    aborted_before = server.sample("loraplex_requests_finished_total", 'finish_reason="abort"')

    async def one(sdk: openai.AsyncOpenAI, i: int) -> tuple[int, str | None, int | None, str]:
        stream = await sdk.chat.completions.create(
            model=BASE if i % 2 else "uppercase",
            messages=[{"role": "user", "content": f"Story number {i}: once upon a time"}],
            max_tokens=max_tokens,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
        )
        pieces, reason, used = 0, None, None
        async for chunk in stream:
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                pieces += 1
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            if i in leavers and pieces >= 2:
                await stream.close()  # hang up: the socket closes mid-stream
                return i, None, None, "left"
        return i, reason, used, "stayed"

    async def main() -> list[tuple[int, str | None, int | None, str]]:
        sdk = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1",
            api_key="unused",
            default_headers=INTERNAL,
            max_retries=0,
            timeout=120,
        )
        try:
            return await asyncio.gather(*(one(sdk, i) for i in range(clients)))
        finally:
            await sdk.close()

    results = asyncio.run(main())
    stayed = [r for r in results if r[3] == "stayed"]
    assert len(stayed) == clients - len(leavers)
    assert all(reason == "length" and used == max_tokens for _, reason, used, _ in stayed)
    server.wait_idle()
    assert kv_pages(server) == 0
    assert server.engine.pool.pages_by_kind()["kv"] == 0
    assert not server.engine.scheduler.running and not server.engine.scheduler.waiting
    aborted = server.sample("loraplex_requests_finished_total", 'finish_reason="abort"') - aborted_before
    assert aborted == len(leavers)


def test_a_whole_answer_abandoned_by_its_client_is_aborted(server: Server) -> None:
    aborted_before = server.sample("loraplex_requests_finished_total", 'finish_reason="abort"')
    body = {"model": BASE, "messages": QUESTION, "max_tokens": 400, **NO_EOS}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=INTERNAL, timeout=1.5)
    server.wait_idle()
    assert server.sample("loraplex_requests_finished_total", 'finish_reason="abort"') == aborted_before + 1
    assert kv_pages(server) == 0


def test_a_full_queue_answers_429_with_retry_after(make_server: ServerFactory) -> None:
    small = make_server(engine={"max_num_seqs": 1}, max_queue=1)
    sdk = openai.OpenAI(
        base_url=f"{small.url}/v1", api_key="unused", default_headers=INTERNAL, max_retries=0, timeout=120
    )
    running = sdk.chat.completions.create(
        model=BASE, messages=QUESTION, max_tokens=1000, stream=True, extra_body=NO_EOS
    )
    next(iter(running))
    queued: list[Any] = []
    # Its answer (headers included) waits for its first token, so it goes on a thread.
    waiter = threading.Thread(
        target=lambda: queued.append(
            sdk.chat.completions.create(model=BASE, messages=QUESTION, max_tokens=4, stream=True)
        )
    )
    waiter.start()
    try:
        deadline = time.monotonic() + 30
        while small.sample("loraplex_requests_waiting") < 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.05)
        with pytest.raises(openai.RateLimitError) as refused:
            sdk.chat.completions.create(model=BASE, messages=QUESTION, max_tokens=4)
        assert refused.value.response.headers["retry-after"] == "1"
        assert refused.value.code == "queue_full" and "limit is 1" in refused.value.message
        assert small.sample("loraplex_requests_rejected_total", 'reason="queue_full"') == 1
    finally:
        running.close()
        waiter.join(timeout=60)
    assert "".join(c.choices[0].delta.content or "" for c in queued[0] if c.choices)
    small.wait_idle()
    assert kv_pages(small) == 0


def failing_step(engine: LLMEngine, after: int = 0) -> Callable[[], list[Any]]:
    """engine.step, but the call after `after` good ones raises once (then the real step is back)."""
    real, calls = engine.step, [0]

    def step() -> list[Any]:
        calls[0] += 1
        if calls[0] > after:
            del engine.step  # the class's step again
            raise RuntimeError("injected step failure")
        return real()

    return step


def test_a_failing_step_fails_its_requests_and_serving_goes_on(server: Server) -> None:
    sdk = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", default_headers=INTERNAL, max_retries=0, timeout=60
    )
    errors_before = server.sample("loraplex_engine_step_errors_total")
    server.engine.step = failing_step(server.engine)
    with pytest.raises(openai.InternalServerError) as failed:
        sdk.chat.completions.create(model=BASE, messages=QUESTION, max_tokens=4)
    assert failed.value.code == "engine_error" and "the engine failed while running" in failed.value.message
    # The cause stays in the engine's log: its text may hold other requests' ids or a tenant's values.
    assert "injected step failure" not in failed.value.message

    # Mid-stream: the stream ends with OpenAI's error event, which the client raises.
    server.engine.step = failing_step(server.engine, after=3)
    stream = sdk.chat.completions.create(
        model=BASE, messages=QUESTION, max_tokens=50, stream=True, extra_body=NO_EOS
    )
    with pytest.raises(openai.APIError) as broken:
        for _ in stream:
            pass
    assert "the engine failed while running" in broken.value.message
    assert "injected step failure" not in broken.value.message

    assert server.sample("loraplex_engine_step_errors_total") == errors_before + 2
    assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200
    answer = sdk.chat.completions.create(model=BASE, messages=QUESTION, max_tokens=4)
    assert answer.choices[0].message.content
    server.wait_idle()
    assert kv_pages(server) == 0


def test_a_dead_loop_makes_ready_honest(make_server: ServerFactory) -> None:
    doomed = make_server()
    engine = doomed.engine

    def broken(request_id: str) -> None:
        raise RuntimeError("the engine state is corrupt")

    engine.abort = broken
    engine.step = failing_step(engine)
    answer = httpx.post(
        f"{doomed.url}/v1/completions",
        json={"model": BASE, "prompt": "Hi", "max_tokens": 4},
        headers=INTERNAL,
        timeout=30,
    )
    assert answer.status_code == 503 and "corrupt" in answer.json()["error"]["message"]
    ready = httpx.get(f"{doomed.url}/ready", timeout=10)
    assert ready.status_code == 503 and "engine loop stopped" in ready.json()["reason"]
    again = httpx.post(
        f"{doomed.url}/v1/completions",
        json={"model": BASE, "prompt": "Hi", "max_tokens": 4},
        headers=INTERNAL,
        timeout=30,
    )
    assert again.status_code == 503 and again.headers["retry-after"]
    # The loop will not come back: liveness fails too, so Kubernetes restarts the process.
    health = httpx.get(f"{doomed.url}/health", timeout=10)
    assert health.status_code == 503 and "corrupt" in health.json()["reason"]


def test_steps_failing_in_a_row_turn_ready_off_until_one_succeeds(server: Server) -> None:
    engine = server.engine

    def always_failing() -> list[Any]:
        raise RuntimeError("injected step failure")

    body = {"model": BASE, "prompt": "Hi", "max_tokens": 2}
    engine.step = always_failing
    try:
        for _ in range(3):
            assert (
                httpx.post(
                    f"{server.url}/v1/completions", json=body, headers=INTERNAL, timeout=30
                ).status_code
                == 500
            )
        not_ready = httpx.get(f"{server.url}/ready", timeout=10)
        assert not_ready.status_code == 503 and "3 engine steps failed" in not_ready.json()["reason"]
    finally:
        del engine.step  # the class's step again
    # Requests are still taken; one that runs clears the record.
    assert (
        httpx.post(f"{server.url}/v1/completions", json=body, headers=INTERNAL, timeout=30).status_code == 200
    )
    assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_probes_while_the_model_loads_and_when_it_fails(
    engine_factory: Callable[..., Callable[[], LLMEngine]],
) -> None:
    release = threading.Event()
    build = engine_factory()

    def slow() -> LLMEngine:
        release.wait(60)
        return build()

    app = create_app(ServerSettings(), slow)
    with serving(app, wait_ready=False) as url:
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        loading = httpx.get(f"{url}/ready", timeout=10)
        assert loading.status_code == 503 and "loading" in loading.json()["reason"]
        early = httpx.post(f"{url}/v1/completions", json={"model": BASE, "prompt": "Hi"}, timeout=10)
        assert early.status_code == 503 and early.json()["error"]["code"] == "not_ready"
        release.set()
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/ready", timeout=10).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)

    fatal: list[str] = []

    def missing() -> LLMEngine:
        raise FileNotFoundError("no model at /nowhere")

    with serving(create_app(ServerSettings(), missing, on_fatal=fatal.append), wait_ready=False) as url:
        deadline = time.monotonic() + 10
        while not fatal:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        failed = httpx.get(f"{url}/ready", timeout=10)
        assert failed.status_code == 503 and "/nowhere" in failed.json()["reason"]
    assert "/nowhere" in fatal[0]


def test_metrics_names_and_histograms(server: Server) -> None:
    sdk = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", default_headers=INTERNAL, max_retries=0, timeout=60
    )
    sdk.completions.create(model="uppercase", prompt="Hello", max_tokens=5, extra_body=NO_EOS)
    server.wait_idle()
    text = server.metrics()
    for name in (
        "loraplex_requests_waiting ",
        "loraplex_requests_running ",
        "loraplex_pool_utilization ",
        'loraplex_pool_pages{kind="adapter"} ',
        'loraplex_pool_pages{kind="free"} ',
        "loraplex_adapters_resident ",
        "loraplex_adapter_loads_total ",
        "loraplex_adapter_evictions_total ",
        "loraplex_adapter_load_seconds_total ",
        "loraplex_prompt_tokens_total ",
        "loraplex_generation_tokens_total ",
        "loraplex_time_to_first_token_seconds_count ",
        "loraplex_inter_token_latency_seconds_count ",
        "loraplex_e2e_request_latency_seconds_count ",
    ):
        assert f"\n{name}" in text, name
    assert server.sample("loraplex_time_to_first_token_seconds_count") >= 1
    assert server.sample("loraplex_inter_token_latency_seconds_count") >= 4
    assert server.sample("loraplex_generation_tokens_total") >= 5
    assert server.sample("loraplex_adapters_resident") >= 1
    engine = server.engine
    pages = engine.pool.pages_by_kind()
    assert server.sample("loraplex_pool_pages", 'kind="adapter"') == pages["adapter"]
    used = engine.pool.num_pages - pages["free"]
    assert server.sample("loraplex_pool_utilization") == pytest.approx(used / engine.pool.num_pages)
