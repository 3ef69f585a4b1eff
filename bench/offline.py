"""Offline throughput: the engine against transformers `generate` on the same requests, same dtype.

32 requests (prompt lengths drawn uniformly from [16, 400] tokens with a fixed seed), 128 new tokens
each, greedy, end-of-sequence ignored so both sides generate exactly the same number of tokens. The
engine takes all requests at once (continuous batching); transformers runs them in batches of 8,
left-padded, in arrival order. Load time is not counted.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from loraplex.engine.model.config import ModelConfig

from .floors import offline_floors


@dataclass
class Result:
    system: str
    dtype: str
    requests: int
    generated_tokens: int
    prompt_tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds


def make_prompts(count: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids from the ordinary part of the vocabulary (no special tokens at the low end).
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def run_engine(
    model: str | None, dtype: str, prompts: list[list[int]], new_tokens: int, quantization: str = "none"
) -> tuple[Result, ModelConfig]:
    from loraplex.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype=dtype, quantization=quantization))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    started = time.perf_counter()
    outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - started
    generated = sum(len(o.token_ids) for o in outputs)
    system = "loraplex" if quantization == "none" else f"loraplex-{quantization}"
    return Result(
        system, dtype, len(prompts), generated, sum(map(len, prompts)), seconds
    ), engine.loaded.config


def run_transformers(dtype: str, prompts: list[list[int]], new_tokens: int, batch_size: int) -> Result:
    from transformers import AutoModelForCausalLM

    from loraplex.engine.model.loader import default_model_path

    path = default_model_path()
    model: Any = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)
    )
    model.eval()
    pad = 2
    generated = 0
    started = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(prompts), batch_size):
            batch = prompts[first : first + batch_size]
            width = max(map(len, batch))
            input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
            generated += (out.shape[1] - width) * len(batch)
    seconds = time.perf_counter() - started
    return Result("transformers", dtype, len(prompts), generated, sum(map(len, prompts)), seconds)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=400)
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--quantization",
        default="none",
        help="the engine's weight-only quantization: none, int8, int4, int4-g128",
    )
    parser.add_argument("--model", default=None, help="engine model (default: SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="also print one JSON line per result")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    prompts = make_prompts(args.requests, args.min_prompt, args.max_prompt, 49152, args.seed)
    print(
        f"offline benchmark: {args.requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens "
        f"({sum(map(len, prompts))} in all), {args.new_tokens} new tokens each; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}"
    )
    print(
        f"{'system':<14}{'dtype':<10}{'seconds':>9}{'gen tok/s':>11}{'vs hf':>8}{'floor':>8}{'of floor':>10}"
    )
    for dtype in args.dtypes.split(","):
        engine, model_config = run_engine(args.model, dtype, prompts, args.new_tokens, args.quantization)
        results = [engine]
        if not args.skip_transformers:
            results.append(run_transformers(dtype, prompts, args.new_tokens, args.hf_batch_size))
        floors, rates = offline_floors(
            model_config, [len(p) for p in prompts], args.new_tokens, getattr(torch, dtype)
        )
        baseline = results[-1].tokens_per_second
        for r in results:
            ratio = r.tokens_per_second / baseline
            print(
                f"{r.system:<14}{r.dtype:<10}{r.seconds:>9.2f}{r.tokens_per_second:>11.1f}{ratio:>7.2f}x"
                f"{floors.total:>7.1f}s{floors.total / r.seconds:>9.0%}"
            )
            if args.json:
                print(json.dumps({**asdict(r), "tokens_per_second": r.tokens_per_second}))
        print(
            f"  floors ({dtype}): prefill {floors.prefill_seconds:.1f}s + "
            f"decode {floors.decode_seconds:.1f}s at "
            f"{rates['prefill_gflops']:.0f} GFLOP/s (1024 rows), {rates['decode_gflops']:.0f} GFLOP/s "
            f"({args.requests} rows), {rates['copy_gbps']:.0f} GB/s copy"
        )
    return 0
