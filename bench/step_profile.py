"""Where a decode step's time goes: the offline workload run to its decode phase, then torch.profiler
over a few steps, printed as milliseconds per step by op."""

from __future__ import annotations

import argparse
import time

from torch.profiler import ProfilerActivity, profile

from .offline import make_prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--quantization", default="none", help="the base model's weights: none, int8, int4..."
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--compile-decode", action="store_true", help="with the compiled decode step")
    parser.add_argument("--model", default=None)
    parser.add_argument("--top", type=int, default=12)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from loraplex.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            device="cpu",
            dtype=args.dtype,
            quantization=args.quantization,
            compile_decode=args.compile_decode,
        )
    )
    vocab = engine.loaded.config.vocab_size
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    for prompt in make_prompts(args.requests, 16, 400, vocab, seed=0):
        engine.add_request(prompt, params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(
        r.num_computed_tokens < len(r.prompt_token_ids) for r in scheduler.running
    ):
        engine.step()
    engine.step()  # warm
    started = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = (time.perf_counter() - started) / args.steps * 1e3  # unprofiled: the profiler adds its own cost
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) / args.steps / 1e3
    print(
        f"decode step, {len(scheduler.running)} sequences, {args.dtype}, quantization {args.quantization}: "
        f"{wall:.1f} ms wall, {total:.1f} ms in ops"
    )
    print(f"{'op':<40}{'ms/step':>9}{'share':>8}{'calls/step':>12}")
    for event in events[: args.top]:
        ms = event.self_cpu_time_total / args.steps / 1e3
        print(f"{event.key:<40}{ms:>9.1f}{ms / total:>8.0%}{event.count / args.steps:>12.0f}")
    return 0
