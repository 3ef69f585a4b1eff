"""Weight-only quantized base models against float32/bfloat16 and llama.cpp, same run (issue 19).

For each engine setting (float32; bfloat16; bfloat16 + int8; bfloat16 + int4) one engine is built on
SmolLM2's GGUF file and measured four ways, greedy, end-of-sequence ignored so every stream generates
exactly `--new-tokens`:
- one stream, no adapter, and one stream with an adapter;
- `--streams` streams at once, no adapter, and the same with `--adapters` distinct synthetic adapters
  (engine/lora/synthetic.py, rank 8) spread round-robin over the streams.
Figures are generated tokens per second over the whole generate call (prefill of the short prompts
included), the best of `--repeats` runs; settings take turns so a spell of load from other processes
does not fall on one only.

llama.cpp (llama-cpp-python, `make bench-deps`) runs the same GGUF file with the same thread count:
one stream, and `--streams` sequences decoded together (one `llama_decode` batch per step, one token per
sequence, each on its own sequence id: llama.cpp's batched decoding). It has no multi-adapter batch, so
its row is without adapters; when llama-cpp-python is missing the rows say so instead of failing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

SETTINGS = (("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8"), ("bfloat16", "int4"))


@dataclass
class Figure:
    system: str
    case: str  # "1 stream", "16 streams", "+ adapters" variants
    streams: int
    generated_tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def _timed_generate(
    engine: Any, prompts: list[list[int]], new_tokens: int, adapters: list[str | None]
) -> float:
    from loraplex.engine import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outputs = engine.generate(prompts, params, adapters)
    seconds = time.perf_counter() - started
    failed = [o.error for o in outputs if o.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, the first: {failed[0]}")
    if any(len(o.token_ids) != new_tokens for o in outputs):
        raise RuntimeError("a stream stopped early: the figures would not count the same tokens")
    return seconds


def engine_cases(args: argparse.Namespace) -> list[tuple[str, int, list[str | None]]]:
    names = [f"a{i}" for i in range(args.adapters)]
    many = [names[i % len(names)] for i in range(args.streams)]
    return [
        ("1 stream", 1, [None]),
        ("1 stream + 1 adapter", 1, [names[0]]),
        (f"{args.streams} streams", args.streams, [None] * args.streams),
        (f"{args.streams} streams + {args.adapters} adapters", args.streams, list(many)),
    ]


def build_engine(dtype: str, quantization: str, args: argparse.Namespace) -> Any:
    from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
    from loraplex.engine.lora.synthetic import SyntheticAdapter

    engine = LLMEngine(EngineConfig(model=args.model, device="cpu", dtype=dtype, quantization=quantization))
    shape = engine.loaded.config.lora_shape()
    for i in range(args.adapters):
        engine.register_adapter(f"a{i}", SyntheticAdapter(shape, seed=i + 1, rank=8))
    warm = [[101] * 8, [102] * 8]
    engine.generate(warm, SamplingParams(max_tokens=2, temperature=0.0), [None, "a0"])  # one-time costs
    return engine


_quiet_callbacks: list[Any] = []  # a ctypes callback must outlive every call that may use it


def _quiet_log(llama_cpp: Any) -> Any:
    if not _quiet_callbacks:
        _quiet_callbacks.append(llama_cpp.llama_log_callback(lambda level, text, user_data: None))
    return _quiet_callbacks[0]


def llama_cpp_figures(path: str, args: argparse.Namespace, prompts: list[list[int]]) -> list[Figure] | str:
    """llama.cpp on the same file: one stream, then `streams` sequences per llama_decode batch."""
    try:
        import llama_cpp
    except ImportError:
        return "llama-cpp-python is not installed (make bench-deps)"

    threads = torch.get_num_threads()
    streams = args.streams
    # The low-level API: the Llama class has no n_seq_max (its kwargs are dropped), and a context of one
    # sequence refuses a batch that names sequence 1 ("invalid seq_id").
    llama_cpp.llama_log_set(_quiet_log(llama_cpp), None)  # its load log would bury the table
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
    if not model:
        return f"llama.cpp could not load {path}"
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = streams * (args.prompt_len + args.new_tokens + 8)
    params.n_batch = params.n_ubatch = max(512, streams * args.prompt_len)
    params.n_seq_max = streams
    params.n_threads = params.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        llama_cpp.llama_model_free(model)
        return "llama.cpp could not make a context"
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    try:
        return _llama_cpp_cases(llama_cpp, ctx, vocab, args, prompts)
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


def _llama_cpp_cases(
    llama_cpp: Any, ctx: Any, vocab: int, args: argparse.Namespace, prompts: list[list[int]]
) -> list[Figure]:
    import numpy as np

    streams = args.streams
    figures: list[Figure] = []
    for case, count in (("1 stream", 1), (f"{streams} streams", streams)):
        best = float("inf")
        for attempt in range(args.repeats + 1):  # the first run warms up (weight repacking)
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
            batch = llama_cpp.llama_batch_init(max(count * args.prompt_len, count), 0, count)
            try:
                started = time.perf_counter()
                # Prefill every sequence in one batch; logits only at each prompt's last token.
                batch.n_tokens = 0
                for s in range(count):
                    for pos, tok in enumerate(prompts[s]):
                        i = batch.n_tokens
                        batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                        batch.seq_id[i][0] = s
                        batch.logits[i] = int(pos == len(prompts[s]) - 1)
                        batch.n_tokens += 1
                rc = llama_cpp.llama_decode(ctx, batch)
                if rc != 0:
                    raise RuntimeError(f"llama_decode failed in prefill: {rc}")
                rows = [i for i in range(batch.n_tokens) if batch.logits[i]]
                for step in range(args.new_tokens):
                    nxt = []
                    for i in rows:  # greedy, as the engine: argmax of each sequence's logits
                        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(vocab,))
                        nxt.append(int(logits.argmax()))
                    if step == args.new_tokens - 1:
                        break
                    batch.n_tokens = 0
                    for s, tok in enumerate(nxt):
                        batch.token[s], batch.pos[s], batch.n_seq_id[s] = tok, args.prompt_len + step, 1
                        batch.seq_id[s][0] = s
                        batch.logits[s] = 1
                        batch.n_tokens += 1
                    if llama_cpp.llama_decode(ctx, batch) != 0:
                        raise RuntimeError("llama_decode failed in decode")
                    rows = list(range(count))
                if attempt:
                    best = min(best, time.perf_counter() - started)
            finally:
                llama_cpp.llama_batch_free(batch)
        figures.append(Figure("llama.cpp", case, count, count * args.new_tokens, best))
    return figures


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--settings",
        default=",".join(f"{d}:{q}" for d, q in SETTINGS),
        help="dtype:quantization pairs to measure, comma-separated",
    )
    parser.add_argument("--model", default=None, help="engine model (default: SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="also print one JSON line per figure")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from loraplex.engine.model.loader import default_model_path

    settings = [tuple(s.split(":", 1)) for s in args.settings.split(",") if s]
    if any(len(s) != 2 for s in settings):
        raise SystemExit("--settings takes dtype:quantization pairs, e.g. bfloat16:int8")
    engines = {f"{d} {q}": build_engine(d, q, args) for d, q in settings}
    vocab = next(iter(engines.values())).loaded.config.vocab_size
    prompts = make_prompts(args.streams, args.prompt_len, vocab, args.seed)
    cases = engine_cases(args)
    best: dict[tuple[str, str], float] = {}
    for _ in range(args.repeats):
        for label, engine in engines.items():  # settings take turns within each repeat
            for case, count, adapters in cases:
                seconds = _timed_generate(engine, prompts[:count], args.new_tokens, adapters)
                key = (label, case)
                best[key] = min(best.get(key, float("inf")), seconds)
    figures = [
        Figure(f"loraplex {label}", case, count, count * args.new_tokens, best[(label, case)])
        for label in engines
        for case, count, _ in cases
    ]
    llama: list[Figure] | str = "skipped (--skip-llama-cpp)"
    if not args.skip_llama_cpp:
        path = (
            str(args.model) if args.model and str(args.model).endswith(".gguf") else str(default_model_path())
        )
        llama = llama_cpp_figures(path, args, prompts)
        if isinstance(llama, list):
            figures += llama
    print(
        f"# quant: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads; {args.new_tokens} new tokens, "
        f"prompts of {args.prompt_len}, best of {args.repeats}"
    )
    print(f"{'system':32} {'case':28} {'tok/s':>9}")
    for f in figures:
        print(f"{f.system:32} {f.case:28} {f.tokens_per_second:9.1f}")
        if args.json:
            print(json.dumps({**asdict(f), "tokens_per_second": f.tokens_per_second}))
    if isinstance(llama, str):
        print(f"llama.cpp: {llama}")
    return 0
