"""Serving load on loopback: `loraplex serve` under closed-loop streaming clients at fixed concurrency.

For each concurrency level, `concurrency` clients each send a streaming completion, wait for its end and
send the next, until the level's request count is reached (or its time limit: then no new request
starts). Prompts are random token ids of uniformly drawn length (fixed seed); end-of-sequence is ignored
so every request generates exactly --max-tokens. A share of requests names the demo LoRA adapter, so
the figures include multi-adapter batching. The server runs as its own process (as in production: the
clients do not share its interpreter), unless --url points at one already running.

Reported per level: requests/s, generated tokens/s, time to first token and inter-token latency
(p50/p99, measured by the client from the streamed chunks: the engine sends one chunk per token), and
the end-to-end p50.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

DEMO_ADAPTER = Path(__file__).resolve().parents[1] / "fixtures" / "adapters" / "demo-uppercase"
VOCAB_LOW, VOCAB_HIGH = 100, 49000  # ordinary tokens of SmolLM2's vocabulary (no special ones)


@dataclass
class Sample:
    ttft: float
    gaps: list[float]
    seconds: float
    tokens: int


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    seconds: float
    generated_tokens: int
    errors: int
    requests_per_s: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    e2e_p50_s: float
    samples: list[Sample] = field(default_factory=list, repr=False)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> Sample:
    started = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread()).decode()[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"].get("message"))
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
            if any(c.get("text") for c in event.get("choices", [])):
                stamps.append(time.perf_counter())
    ended = time.perf_counter()
    if not stamps:
        raise RuntimeError("the stream carried no text")
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return Sample(stamps[0] - started, gaps, ended - started, tokens)


async def run_level(
    url: str, concurrency: int, requests: int, bodies: list[dict[str, object]], time_limit_s: float
) -> LevelResult:
    samples: list[Sample] = []
    errors: list[str] = []
    next_index = 0
    started = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:

        async def worker() -> None:
            nonlocal next_index
            while next_index < requests and time.perf_counter() - started < time_limit_s:
                body = bodies[next_index % len(bodies)]
                next_index += 1
                try:
                    samples.append(await one_request(client, url, body))
                except (RuntimeError, httpx.HTTPError) as exc:
                    errors.append(str(exc))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - started
    if errors:
        print(f"  {len(errors)} errors at concurrency {concurrency}, e.g. {errors[0]}", file=sys.stderr)
    generated = sum(s.tokens for s in samples)
    gaps = [g for s in samples for g in s.gaps]
    return LevelResult(
        concurrency=concurrency,
        requests=len(samples),
        seconds=seconds,
        generated_tokens=generated,
        errors=len(errors),
        requests_per_s=len(samples) / seconds,
        tokens_per_s=generated / seconds,
        ttft_p50_ms=percentile([s.ttft for s in samples], 50) * 1000,
        ttft_p99_ms=percentile([s.ttft for s in samples], 99) * 1000,
        itl_p50_ms=percentile(gaps, 50) * 1000,
        itl_p99_ms=percentile(gaps, 99) * 1000,
        e2e_p50_s=percentile([s.seconds for s in samples], 50),
        samples=samples,
    )


def make_bodies(
    count: int, min_prompt: int, max_prompt: int, max_tokens: int, adapter_share: float, seed: int, model: str
) -> list[dict[str, object]]:
    rng = random.Random(seed)
    bodies: list[dict[str, object]] = []
    for _ in range(count):
        prompt = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(min_prompt, max_prompt))]
        bodies.append(
            {
                "model": "demo" if rng.random() < adapter_share else model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
    return bodies


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [sys.executable, "-m", "loraplex.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--dtype", args.dtype, "--device", args.device, "--max-num-seqs", str(args.max_num_seqs)]
    command += ["--max-queue", str(max(args.levels) * 4), "--served-model-name", "base"]
    if args.model:
        command += ["--model", args.model]
    if args.num_pages:
        command += ["--num-pages", str(args.num_pages)]
    if args.adapter_share > 0:
        command += ["--adapter", f"demo={DEMO_ADAPTER}"]
    process = subprocess.Popen(command, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return process, f"http://127.0.0.1:{port}"


def wait_ready(url: str, process: subprocess.Popen[bytes] | None, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} did not become ready in {timeout_s:.0f} s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="benchmark this running server instead of starting one")
    parser.add_argument("--levels", default="1,4,16", help="concurrency levels (default 1,4,16)")
    parser.add_argument("--requests", type=int, default=0, help="requests per level (default 2x level, >= 8)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument(
        "--adapter-share", type=float, default=0.5, help="fraction of requests to the adapter"
    )
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds per level at most")
    parser.add_argument("--model", default=None, help="server model (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model", default="base", help="the base model's name at --url")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-pages", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="also print one JSON line per level")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    args.levels = [int(x) for x in args.levels.split(",") if x.strip()]
    process = None
    url = args.url
    if url is None:
        process, url = start_server(args)
    try:
        wait_ready(url, process)
        model = args.served_model if args.url else "base"
        print(
            f"serve benchmark: {url}, levels {args.levels}, prompts {args.min_prompt}-{args.max_prompt} "
            f"tokens, {args.max_tokens} new tokens each (EOS ignored), {args.adapter_share:.0%} to the "
            f"demo adapter, streaming completions"
        )
        warm = make_bodies(2, 8, 8, 4, args.adapter_share, args.seed + 1, model)
        asyncio.run(run_level(url, 2, 2, warm, args.time_limit))
        print(
            f"{'conc':>5}{'reqs':>6}{'secs':>8}{'req/s':>8}{'tok/s':>9}"
            f"{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}{'e2e p50':>9}"
        )
        for concurrency in args.levels:
            count = args.requests or max(8, 2 * concurrency)
            bodies = make_bodies(
                count, args.min_prompt, args.max_prompt, args.max_tokens, args.adapter_share, args.seed, model
            )
            r = asyncio.run(run_level(url, concurrency, count, bodies, args.time_limit))
            print(
                f"{r.concurrency:>5}{r.requests:>6}{r.seconds:>8.1f}{r.requests_per_s:>8.2f}{r.tokens_per_s:>9.1f}"
                f"{r.ttft_p50_ms:>8.0f}ms{r.ttft_p99_ms:>6.0f}ms{r.itl_p50_ms:>7.0f}ms{r.itl_p99_ms:>6.0f}ms"
                f"{r.e2e_p50_s:>8.1f}s"
            )
            if args.json:
                print(json.dumps({k: v for k, v in asdict(r).items() if k != "samples"}))
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
    return 0
