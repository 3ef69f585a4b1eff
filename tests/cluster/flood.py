"""A tenant's traffic for the scale-out story (test_walkthrough.py), in a process of its own so that its
clients never compete with the box's API server and kubelet for the test process's interpreter.

`python -m tests.cluster.flood OUT --key K --hot NAME --quiet A,B,... URL...`: WORKERS clients ask for the
hot adapter back to back while the quiet ones are asked in rounds, TRICKLE at a time, through the
control-plane URLs in turn, until SIGTERM; SIGUSR1 holds new requests (those out finish), SIGUSR2 lets them
go again. Every answer is one JSON line in OUT as it comes ({"model",
"status", "text"}), and each completed round of the quiet adapters a line {"round": n}, so the test reads
the traffic live.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx

TOKENS = 6
TRICKLE = 10  # quiet adapters asked at once (each has 1 request out: its set never grows)


async def main(args: argparse.Namespace) -> None:
    stop, going = asyncio.Event(), asyncio.Event()
    going.set()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: (stop.set(), going.set()))
    loop.add_signal_handler(signal.SIGUSR1, going.clear)
    loop.add_signal_handler(signal.SIGUSR2, going.set)
    with Path(args.out).open("a", buffering=1) as out:  # a line at a time: the test reads it as we write
        await traffic(args, stop, going, out)


async def traffic(args: argparse.Namespace, stop: asyncio.Event, going: asyncio.Event, out: Any) -> None:
    auth = {"Authorization": f"Bearer {args.key}"}
    # Idle connections are dropped after 2 s, before the control plane's server closes them (uvicorn's
    # keep-alive lasts 5 s): a request on a connection the server is closing fails with a ReadError
    # before it is sent, a race of keep-alive itself (the openai SDK retries those), not a failed request.
    limits = httpx.Limits(max_connections=args.workers + 4, keepalive_expiry=2.0)
    clients = [httpx.AsyncClient(base_url=u, headers=auth, timeout=180, limits=limits) for u in args.urls]

    def record(line: dict[str, Any]) -> None:
        out.write(json.dumps(line) + "\n")

    async def ask(client: httpx.AsyncClient, model: str, seed: int) -> None:
        await going.wait()
        if stop.is_set():
            return
        body = {"model": model, "prompt": f"Item {seed}: say it loud.", "max_tokens": TOKENS,
                "ignore_eos": True, "temperature": 0}  # fmt: skip
        began = time.time()
        try:
            answer = await client.post("/v1/completions", json=body)
            record({"model": model, "status": answer.status_code, "text": answer.text[:300]})
        except httpx.HTTPError as error:
            record({"model": model, "status": 0, "text": repr(error), "url": str(client.base_url),
                    "began": began, "failed": time.time()})  # fmt: skip

    async def flood(worker: int) -> None:
        i = 0
        while not stop.is_set():
            await ask(clients[worker % len(clients)], args.hot, worker * 10_000 + i)
            i += 1

    async def trickle() -> None:
        # A round asks each quiet adapter once, TRICKLE of them at a time: each of those requests waits for
        # its adapter's load on a flooded pod, and one at a time a round took over a minute on 2 cores.
        rounds = 0
        while not stop.is_set():
            for first in range(0, len(args.quiet), TRICKLE):
                if stop.is_set():
                    return
                batch = list(enumerate(args.quiet))[first : first + TRICKLE]
                await asyncio.gather(
                    *(ask(clients[i % len(clients)], model, rounds * 100 + i) for i, model in batch)
                )
            rounds += 1
            record({"round": rounds})

    try:
        await asyncio.gather(trickle(), *(flood(w) for w in range(args.workers)))
    finally:
        for client in clients:
            await client.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("urls", nargs="+")
    parser.add_argument("--key", required=True)
    parser.add_argument("--hot", required=True)
    parser.add_argument("--quiet", type=lambda text: text.split(","), required=True)
    parser.add_argument("--workers", type=int, default=16)
    asyncio.run(main(parser.parse_args()))
