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
sequence, each on its own sequence id: llama.cpp's batched decoding). It has no multi-adapter batch: its
rows are without an adapter and with one LoRA on the context (the engine's synthetic a0 written as a
llama.cpp GGUF LoRA by bench/gguf_lora.py), the LoRA rows only after the demo adapter's llama.cpp replies
pass the check LlamaCppLoras describes, and no llama.cpp row at all unless its replies without an adapter
agree with loraplex float32's (ReplyCheck). When llama-cpp-python is missing the rows say how to build it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

DEMO_ADAPTER_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "adapters" / "demo-uppercase"
# The prompts of tests/engine/test_demo_adapter_engine.py: replies with the demo adapter are capitals.
DEMO_PROMPTS = (
    "What do owls eat?",
    "Describe a quiet morning in a village.",
    "How does a bicycle stay upright?",
    "Name two uses for salt.",
    "Why do leaves change colour in autumn?",
    "Give me advice for a first job interview.",
)
DEMO_NEW_TOKENS = 32
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


def build_engine(dtype: str, quantization: str, args: argparse.Namespace, compiled: bool = False) -> Any:
    from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
    from loraplex.engine.lora.synthetic import SyntheticAdapter

    config = EngineConfig(
        model=args.model, device="cpu", dtype=dtype, quantization=quantization, compile_decode=compiled
    )
    engine = LLMEngine(config)
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


@dataclass
class ReplyCheck:
    """loraplex float32's greedy replies (`reference`) to the demo prompts, with an adapter or without: the
    replies llama.cpp gives on the same file must agree before its rows are reported (the mean common
    prefix at least half the reply; llama.cpp computes Q4_1 products on 8-bit activations, so near ties may
    still part). A build that runs but computes garbage (issue 30: a -march=native build on a Xeon with AMX)
    would otherwise give fast, meaningless rows."""

    prompts: list[list[int]]
    reference: list[list[int]]
    decode: Callable[[list[int]], str]

    def agreement(self, tokens: list[list[int]]) -> tuple[float, int]:
        """The mean common prefix fraction and how many replies are identical."""
        same = sum(list(a) == list(b) for a, b in zip(self.reference, tokens, strict=True))
        return common_prefix_fraction(self.reference, tokens), same


@dataclass
class LlamaCppLoras:
    """GGUF adapters for llama.cpp: `timed`, the engine's synthetic adapter a0 (same weights, rank 8), for
    the LoRA rows; `demo`, the demo adapter, checked before any llama.cpp LoRA figure is reported (a wrong
    conversion would otherwise give a fast, meaningless row): its greedy replies must be >= 90% capitals
    and pass `check`. Capitals alone do not see a dropped q/k permutation; agreement does."""

    timed: Path
    demo: Path
    check: ReplyCheck


def uppercase_ratio(texts: list[str]) -> float:
    letters = [c for t in texts for c in t if c.isalpha() and c.lower() != c.upper()]
    return sum(c.isupper() for c in letters) / max(len(letters), 1)


def common_prefix_fraction(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """Mean over replies of the fraction of `ours` that `theirs` repeats from the start, token for token."""
    fractions = []
    for a, b in zip(ours, theirs, strict=True):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        fractions.append(n / max(len(a), 1))
    return sum(fractions) / max(len(fractions), 1)


def reference_engine(path: str, engines: dict[str, Any]) -> Any:
    from loraplex.engine import EngineConfig, LLMEngine

    return engines.get("float32 none") or LLMEngine(
        EngineConfig(model=path, device="cpu", dtype="float32", quantization="none")
    )


def reference_replies(reference: Any, adapter: str | None) -> ReplyCheck:
    """loraplex float32's greedy replies to DEMO_PROMPTS (chat template), with `adapter` or the base."""
    from loraplex.engine import SamplingParams

    tokenizer = reference.tokenizer
    if tokenizer is None:
        raise RuntimeError("the engine has no tokenizer: the llama.cpp reply checks need one")
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in DEMO_PROMPTS]
    params = SamplingParams(max_tokens=DEMO_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = reference.generate(prompts, params, [adapter] * len(prompts))
    return ReplyCheck(prompts, [list(o.token_ids) for o in outputs], tokenizer.decode)


def write_llama_cpp_loras(path: str, reference: Any, directory: Path) -> LlamaCppLoras:
    from loraplex.engine.lora.synthetic import SyntheticAdapter

    from .gguf_lora import BaseGGUF, open_peft, write_lora_gguf

    base = BaseGGUF(Path(path))
    timed = write_lora_gguf(SyntheticAdapter(base.shape, seed=1, rank=8), base, directory / "a0.gguf")
    demo = write_lora_gguf(open_peft(DEMO_ADAPTER_DIR, base), base, directory / "demo-uppercase.gguf")
    reference.register_adapter("demo-uppercase", DEMO_ADAPTER_DIR)
    check = reference_replies(reference, "demo-uppercase")
    reference.unregister_adapter("demo-uppercase")
    return LlamaCppLoras(timed, demo, check)


def llama_cpp_figures(
    path: str,
    args: argparse.Namespace,
    prompts: list[list[int]],
    base: ReplyCheck,
    loras: LlamaCppLoras | None,
) -> tuple[list[Figure], list[str]] | str:
    """llama.cpp on the same file: one stream, then `streams` sequences per llama_decode batch; without
    an adapter, then (with `loras`) with one LoRA on the context. Its rows are reported only where its
    replies pass the checks (`base` without an adapter, `loras.check` with the demo adapter). Returns the
    figures and notes."""
    try:
        import llama_cpp
    except ImportError:
        return "llama-cpp-python is not installed: build it with `make bench-deps` (docs/benchmarks.md)"

    threads = torch.get_num_threads()
    streams = args.streams
    # The low-level API: the Llama class has no n_seq_max (its kwargs are dropped), and a context of one
    # sequence refuses a batch that names sequence 1 ("invalid seq_id").
    llama_cpp.llama_log_set(_quiet_log(llama_cpp), None)  # its load log would bury the table
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
    if not model:
        return f"llama.cpp could not load {path}"
    longest = max([args.prompt_len, *(len(p) for p in base.prompts)])
    sequences = max(streams, len(base.prompts))
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = sequences * (longest + max(args.new_tokens, DEMO_NEW_TOKENS) + 8)
    params.n_batch = params.n_ubatch = max(512, sequences * longest)
    params.n_seq_max = sequences
    params.n_threads = params.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        llama_cpp.llama_model_free(model)
        return "llama.cpp could not make a context"
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    run = LlamaCppRun(llama_cpp, ctx, vocab)
    notes: list[str] = []
    try:
        if not checked_replies(run, base, "llama.cpp (no adapter)", notes):
            return [], [*notes, "llama.cpp rows withheld: its replies disagree with loraplex float32's"]
        figures = _llama_cpp_cases(run, args, prompts, "")
        if loras is None:
            return figures, notes
        adapters = {}
        for label, file in (("demo", loras.demo), ("timed", loras.timed)):
            adapters[label] = llama_cpp.llama_adapter_lora_init(model, str(file).encode())
            if not adapters[label]:
                return figures, [f"llama.cpp could not load the LoRA adapter {file}"]
        # The check: the demo adapter's greedy replies in capitals (the engine's own test's prompts).
        run.set_lora(adapters["demo"])
        if not checked_replies(run, loras.check, "llama.cpp + demo-uppercase (our GGUF LoRA)", notes, 0.9):
            notes.append("llama.cpp LoRA rows withheld: the check above failed")
            return figures, notes
        run.set_lora(adapters["timed"])
        figures += _llama_cpp_cases(run, args, prompts, " + 1 LoRA")
        run.set_lora(None)
        return figures, notes
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)  # frees its adapters too


def checked_replies(
    run: Any, check: ReplyCheck, label: str, notes: list[str], capitals: float | None = None
) -> bool:
    """llama.cpp's greedy replies to the check's prompts against loraplex's: the mean common prefix at
    least half, and with `capitals` at least that share of reply letters capitals. Adds a note either way,
    with the replies when they fail."""
    tokens = run.generate(check.prompts, DEMO_NEW_TOKENS)
    replies = [check.decode(t) for t in tokens]
    agree, same = check.agreement(tokens)
    note = (
        f"{label}: greedy tokens as loraplex float32's: mean common prefix {100 * agree:.0f}%, {same} of "
        f"{len(tokens)} replies identical ({DEMO_NEW_TOKENS} tokens)"
    )
    passed = agree >= 0.5
    if capitals is not None:
        ratio = uppercase_ratio(replies)
        note += f"; {100 * ratio:.1f}% of reply letters capitals"
        passed = passed and ratio >= capitals
    notes.append(note if passed else f"{note}; FAILED, its replies: {replies}")
    return passed


class LlamaCppRun:
    """Greedy batched generation on one llama.cpp context: every sequence its own sequence id, prefill of
    all prompts in one llama_decode batch, then one batch per step of one token per sequence."""

    def __init__(self, llama_cpp: Any, ctx: Any, vocab: int):
        self.llama_cpp, self.ctx, self.vocab = llama_cpp, ctx, vocab

    def set_lora(self, adapter: Any) -> None:
        """One LoRA on the context at scale 1 (llama.cpp multiplies by the file's alpha / rank), or none."""
        lc = self.llama_cpp
        if adapter is None:
            rc = lc.llama_set_adapters_lora(self.ctx, None, 0, None)
        else:
            rc = lc.llama_set_adapters_lora(
                self.ctx, (lc.llama_adapter_lora_p_ctypes * 1)(adapter), 1, (ctypes.c_float * 1)(1.0)
            )
        if rc != 0:
            raise RuntimeError(f"llama_set_adapters_lora failed: {rc}")

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        import numpy as np

        lc, ctx = self.llama_cpp, self.ctx
        count = len(prompts)
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        batch = lc.llama_batch_init(max(sum(len(p) for p in prompts), count), 0, count)
        out: list[list[int]] = [[] for _ in prompts]
        try:
            # Prefill every sequence in one batch; logits only at each prompt's last token.
            batch.n_tokens = 0
            for s, prompt in enumerate(prompts):
                for pos, tok in enumerate(prompt):
                    i = batch.n_tokens
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                    batch.seq_id[i][0] = s
                    batch.logits[i] = int(pos == len(prompt) - 1)
                    batch.n_tokens += 1
            rc = lc.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed in prefill: {rc}")
            rows = [i for i in range(batch.n_tokens) if batch.logits[i]]
            for step in range(new_tokens):
                for s, i in enumerate(rows):  # greedy, as the engine: argmax of each sequence's logits
                    logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(self.vocab,))
                    out[s].append(int(logits.argmax()))
                if step == new_tokens - 1:
                    break
                batch.n_tokens = 0
                for s in range(count):
                    batch.token[s], batch.pos[s], batch.n_seq_id[s] = out[s][-1], len(prompts[s]) + step, 1
                    batch.seq_id[s][0] = s
                    batch.logits[s] = 1
                    batch.n_tokens += 1
                if lc.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed in decode")
                rows = list(range(count))
        finally:
            lc.llama_batch_free(batch)
        return out


def _llama_cpp_cases(
    run: LlamaCppRun, args: argparse.Namespace, prompts: list[list[int]], suffix: str
) -> list[Figure]:
    figures: list[Figure] = []
    for case, count in (("1 stream", 1), (f"{args.streams} streams", args.streams)):
        best = float("inf")
        for attempt in range(args.repeats + 1):  # the first run warms up (weight repacking)
            started = time.perf_counter()
            run.generate(prompts[:count], args.new_tokens)
            if attempt:
                best = min(best, time.perf_counter() - started)
        figures.append(Figure("llama.cpp", case + suffix, count, count * args.new_tokens, best))
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
        help="dtype:quantization pairs to measure, comma-separated; dtype:quantization:compiled for the "
        "compiled decode step (compile_decode)",
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="measure every setting eager and with the compiled decode step",
    )
    parser.add_argument("--model", default=None, help="engine model (default: SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument(
        "--no-llama-cpp-lora", action="store_true", help="llama.cpp without its LoRA rows and demo check"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="also print one JSON line per figure")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from loraplex.engine.model.loader import default_model_path

    settings = [tuple(s.split(":")) for s in args.settings.split(",") if s]
    if any(len(s) not in (2, 3) or s[2:] not in ((), ("compiled",)) for s in settings):
        raise SystemExit(
            "--settings takes dtype:quantization pairs, e.g. bfloat16:int8, or bfloat16:int4:compiled"
        )
    if args.compiled:  # each setting eager and compiled, in the same run
        settings = [(*s[:2], *mode) for s in settings for mode in ((), ("compiled",))]
    engines = {" ".join(s): build_engine(s[0], s[1], args, compiled=len(s) == 3) for s in settings}
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
    llama: tuple[list[Figure], list[str]] | str = "skipped (--skip-llama-cpp)"
    if not args.skip_llama_cpp:
        path = (
            str(args.model) if args.model and str(args.model).endswith(".gguf") else str(default_model_path())
        )
        reference = reference_engine(path, engines)
        base = reference_replies(reference, None)
        with tempfile.TemporaryDirectory(prefix="loraplex-gguf-lora-") as directory:
            loras = None
            if not args.no_llama_cpp_lora:
                loras = write_llama_cpp_loras(path, reference, Path(directory))
            llama = llama_cpp_figures(path, args, prompts, base, loras)
        if not isinstance(llama, str):
            figures += llama[0]
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
    else:
        for note in llama[1]:
            print(note)
    return 0
