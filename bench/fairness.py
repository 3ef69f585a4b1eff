"""Tenant fairness (issue 18): tenant A keeps 32 long requests queued, tenant B sends one short request
every period; B's time to first token with first-come-first-served, with the virtual token counters
(`scheduling=fair`), and on an idle engine (B alone), in the same run.

Engine mode drives an LLMEngine in this process; server mode starts `loraplex serve` with an internal
token and sends A's and B's requests over HTTP with the gateway's tenant header, once per scheduling.
`engine_ttfts` takes a clock, so tests/engine/test_fairness.py runs the same scenario counting steps.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

VOCAB_LOW, VOCAB_HIGH = 100, 49000  # ordinary tokens of SmolLM2's vocabulary
# A's outputs run from a_tokens/8 to a_tokens in eighths (a fixed cycle): running requests end at staggered
# steps, as real ones do, rather than all in the same step.
STAGGER = (3, 8, 1, 6, 4, 7, 2, 5)


@dataclass(frozen=True)
class Scenario:
    a_queue: int = 32  # A's requests kept waiting (topped up after every step)
    a_prompt: int = 256
    a_tokens: int = 64
    b_prompt: int = 16
    b_tokens: int = 4
    b_requests: int = 8  # B's requests measured
    period: float = 1.0  # between B's requests, in the clock's unit


def _prompt(length: int, seed: int, high: int = VOCAB_HIGH) -> list[int]:
    low = min(VOCAB_LOW, high // 4)
    return [low + (seed * 7919 + i * 104729) % (high - low) for i in range(length)]


def engine_ttfts(
    engine, scenario: Scenario, clock: Callable[[], float], tick: Callable[[], None]
) -> list[float]:
    """Run the scenario on `engine` (its scheduling is already chosen) and return B's times to first
    token, in `clock`'s unit. `tick` is called after each step (a step-counting clock advances there)."""
    from loraplex.engine import SamplingParams
    from loraplex.engine.request import RequestStatus

    a_params = [
        SamplingParams(max_tokens=max(1, scenario.a_tokens * k // 8), ignore_eos=True) for k in STAGGER
    ]
    b_params = SamplingParams(max_tokens=scenario.b_tokens, ignore_eos=True)
    vocab = engine.loaded.config.vocab_size
    a_ids: set[str] = set()
    b_arrival: dict[str, float] = {}
    ttfts: dict[str, float] = {}
    next_b = clock()
    sent = 0
    while len(ttfts) < scenario.b_requests:
        if sent < scenario.b_requests and clock() >= next_b:
            rid = engine.add_request(_prompt(scenario.b_prompt, 10_000 + sent, vocab), b_params, tenant="B")
            b_arrival[rid] = clock()
            sent += 1
            next_b += scenario.period
        waiting = set(engine.request_ids(RequestStatus.WAITING))
        for _ in range(scenario.a_queue - len(a_ids & waiting)):
            params = a_params[len(a_ids) % len(a_params)]
            a_ids.add(engine.add_request(_prompt(scenario.a_prompt, len(a_ids), vocab), params, tenant="A"))
        outputs = engine.step()
        tick()
        for out in outputs:
            if out.request_id in b_arrival and out.token_ids and out.request_id not in ttfts:
                ttfts[out.request_id] = clock() - b_arrival[out.request_id]
    for rid in a_ids | set(b_arrival):
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return list(ttfts.values())


def make_engine(model: str, scheduling: str, **options):
    from loraplex.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=model, device="cpu", scheduling=scheduling, **options))


def _summary(values: list[float], unit: str) -> str:
    return f"p50 {statistics.median(values):.3g}{unit}  max {max(values):.3g}{unit}  (n={len(values)})"


def run_engine(args: argparse.Namespace, scenario: Scenario) -> dict[str, list[float]]:
    options = dict(max_num_seqs=args.max_num_seqs, max_batch_tokens=args.max_batch_tokens)
    results: dict[str, list[float]] = {}
    for label, scheduling, queue in (("idle", "fair", 0), ("fcfs", "fcfs", None), ("fair", "fair", None)):
        engine = make_engine(args.model, scheduling, **options)
        run = scenario if queue is None else Scenario(**{**scenario.__dict__, "a_queue": queue})
        engine_ttfts(engine, Scenario(**{**run.__dict__, "b_requests": 1}), time.perf_counter, lambda: None)
        results[label] = engine_ttfts(engine, run, time.perf_counter, lambda: None)
    return results


# -- server mode ----------------------------------------------------------------------------------------

TOKEN = "bench-internal-token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: str, scheduling: str, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    # The load generator (this process, 32 and more streams) runs on the same machine: the server's
    # torch threads leave it a core, as they would leave the cores of another machine alone. With an
    # OpenMP team as wide as the machine, every op of a step waits for a thread the client descheduled.
    env = {**os.environ, "LORAPLEX_INTERNAL_TOKEN": TOKEN, "OMP_NUM_THREADS": str(args.server_threads)}
    command = [
        sys.executable, "-m", "loraplex.cli", "serve", "--model", model, "--device", "cpu",
        "--port", str(port),
        "--scheduling", scheduling, "--max-num-seqs", str(args.max_num_seqs),
        "--max-batch-tokens", str(args.max_batch_tokens),
    ]  # fmt: skip
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"loraplex serve exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.terminate()
    raise RuntimeError("loraplex serve did not get ready in 300 s")


async def _ttft(client: httpx.AsyncClient, url: str, tenant: str, prompt: list[int], tokens: int) -> float:
    from loraplex import wire

    headers = wire.request_headers(TOKEN, wire.TenantRef(tenant))
    body = {"model": "base", "prompt": prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True}
    if tenant == "B":
        # Every token of B's makes a chunk, even one that adds no text: a random model has no tokenizer,
        # so without logprobs B's first chunk would be its last, timing the whole reply. (A's replies
        # stream as a real model's would only in text: on a random model, one chunk at the end.)
        body["logprobs"] = 0
    start = time.perf_counter()
    first = None
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    assert first is not None, "no token streamed"
    return first


async def server_ttfts(url: str, scenario: Scenario, vocab: int) -> list[float]:
    """A keeps `a_queue` requests in flight (each ended one is replaced); B sends one every period."""
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:

        async def tenant_a(slot: int) -> None:
            n = 0
            while not stop.is_set():
                prompt = _prompt(scenario.a_prompt, slot * 1000 + n, vocab)
                tokens = max(1, scenario.a_tokens * STAGGER[(slot + n) % len(STAGGER)] // 8)
                await _ttft(client, url, "A", prompt, tokens)
                n += 1

        hogs = [asyncio.create_task(tenant_a(i)) for i in range(scenario.a_queue)]
        await asyncio.sleep(scenario.period if scenario.a_queue else 0)
        b_tasks = []
        for i in range(scenario.b_requests):
            b_tasks.append(
                asyncio.create_task(
                    _ttft(client, url, "B", _prompt(scenario.b_prompt, i, vocab), scenario.b_tokens)
                )
            )
            await asyncio.sleep(scenario.period)
        ttfts = list(await asyncio.gather(*b_tasks))
        stop.set()
        for task in hogs:
            task.cancel()
        await asyncio.gather(*hogs, return_exceptions=True)
    return ttfts


def run_server(args: argparse.Namespace, scenario: Scenario) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {}
    for label, scheduling, queue in (("idle", "fair", 0), ("fcfs", "fcfs", None), ("fair", "fair", None)):
        process, url = start_server(args.model, scheduling, args)
        try:
            run = scenario if queue is None else Scenario(**{**scenario.__dict__, "a_queue": queue})
            vocab = (
                512 if args.model.startswith("random:") else VOCAB_HIGH
            )  # random models: a 512-token vocabulary
            results[label] = asyncio.run(server_ttfts(url, run, vocab))
        finally:
            process.terminate()
            process.wait(timeout=60)
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=("engine", "server"), default="engine")
    parser.add_argument("--model", default="random:tiny")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-batch-tokens", type=int, default=256)
    parser.add_argument("--a-queue", type=int, default=32)
    parser.add_argument("--a-prompt", type=int, default=256)
    parser.add_argument("--a-tokens", type=int, default=64)
    parser.add_argument("--b-prompt", type=int, default=16)
    parser.add_argument("--b-requests", type=int, default=8)
    parser.add_argument("--period", type=float, default=1.0, help="seconds between B's requests")
    parser.add_argument(
        "--server-threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 1),
        help="the server's torch threads in server mode (default: one core fewer than the machine has, "
        "left to this process, which generates the load)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    scenario = Scenario(
        a_queue=args.a_queue, a_prompt=args.a_prompt, a_tokens=args.a_tokens, b_prompt=args.b_prompt,
        b_requests=args.b_requests, period=args.period,
    )  # fmt: skip
    print(
        f"fairness benchmark ({args.mode}, {args.model}): A keeps {scenario.a_queue} requests of "
        f"{scenario.a_prompt}+{scenario.a_tokens} tokens queued, B sends {scenario.b_prompt}+"
        f"{scenario.b_tokens} every {scenario.period} s; max_num_seqs {args.max_num_seqs}, "
        f"max_batch_tokens {args.max_batch_tokens}"
        + (f", server threads {args.server_threads}" if args.mode == "server" else "")
    )
    results = (run_engine if args.mode == "engine" else run_server)(args, scenario)
    idle = statistics.median(results["idle"])
    for label in ("idle", "fcfs", "fair"):
        values = [v * 1000 for v in results[label]]
        ratio = statistics.median(results[label]) / idle
        print(f"B's TTFT {label:>5}: {_summary(values, 'ms')}  p50/idle {ratio:.2f}x")
    return 0
