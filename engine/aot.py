"""Ahead-of-time compilation of every Triton kernel variant the engine launches, for GPUs we lack.

`python -m loraplex.engine.aot` (run by tests/engine/kernels/test_aot.py in a subprocess
without TRITON_INTERPRET) proves on a CPU-only machine that each variant compiles for sm_80 and sm_90
and that none spills registers in 16-bit dtypes. Three stages:

1. Record. `capture(on_launch)` swaps triton's `JITFunction.run` for the duration: `kernel[grid](...)`
   hands its arguments to `on_launch` instead of launching. `record_variants` runs the engine's own code
   on `meta` tensors for each StepShape: the model's forward (engine/model/llama.py) with the runner's
   attention (`TritonAttention`) and LoRA step (`KernelLoraStep`) over a batch laid out by the real
   `BatchBuilder`, inside `gpu.targeting(target)` so the wrappers' block, split and tile choices are the
   target GPU's. Each launch is bound and specialized as triton binds a CUDA launch (signature, constexprs,
   divisibility attributes, num_warps, num_stages) into a `Variant`; identical ones count once.
2. Compile. Each distinct (Variant, arch) goes through `triton.compile(ASTSource(...),
   target=GPUTarget("cuda", arch, 32))` with the ptxas in the triton wheel, whose `-v` log gives registers
   and spills, in a process pool of 2. Reports are cached as JSON in ~/.cache/loraplex/aot (or
   $LORAPLEX_AOT_CACHE), keyed by triton's version, the kernel's source hash, the variant and the arch, so
   a second run compiles only what changed.
3. Judge. A compile error fails the gate; so does a spill in a variant with 16-bit tensors (float32
   variants are for checking results, and their spills are reported, not refused).

The start-up warm-up (warmup.py) records the same way for one engine's shapes and compiles on its GPU.

Adding a kernel
- Launched from code the drivers already run (the model's forward, the attention callables, the LoRA
  step)? Nothing to do: it is recorded at every StepShape. If the model takes the kernel path only when
  something is switched on, switch it on in `_drive_step`.
- Launched elsewhere (say a quantized matmul's wrapper)? Write `def drive_x(step: StepShape) -> None`
  that calls the wrapper with meta tensors at the shapes `step` implies (`step.config`, `step.dtype`,
  `step.tokens`) and append it to DRIVERS. Wrappers must take their sizes from shapes or host-side
  arguments, never from a tensor's values (meta tensors have none; reading one is a device sync anyway).
- New shapes (another model, batch bucket, rank): extend MODELS or `gate_shapes`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .kernels.gpu import A100, H100, GpuTarget, targeting
from .model.config import NAMED_SHAPES, ModelConfig

# The shapes the issue names: Llama-2-7B (MHA, head_dim 128), Llama-3-8B (GQA 4:1, vocab 128k) and
# SmolLM2-135M (the default model: 9 heads, 3 kv heads, head_dim 64, widths not powers of two).
MODELS = {
    "llama-2-7b": NAMED_SHAPES["llama-7b"],
    "llama-3-8b": NAMED_SHAPES["llama3-8b"],
    "smollm2-135m": NAMED_SHAPES["smollm2-135m"],
}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TARGETS = (A100, H100)
# Layers the recorded model has: every layer runs the same launches, and a second one shows whether
# the layer index leaked into a kernel's specialization (it is a runtime argument everywhere).
RECORD_LAYERS = 2
RECORD_POSITIONS = 8192  # rotary table rows of the recorded model: beyond every StepShape's positions


@dataclass(frozen=True)
class StepShape:
    """One step the engine may run: `decodes` one-token rows with `context` tokens each, then prefill
    chunks of `prefills` tokens; every request uses a LoRA adapter of rank `rank` (0: none do)."""

    config: ModelConfig
    dtype: torch.dtype
    decodes: int = 0
    context: int = 1
    prefills: tuple[int, ...] = ()
    rank: int = 0
    page_size: int = 16
    adapters: int = 4  # distinct adapters in the step, spread over its requests

    @property
    def tokens(self) -> int:
        return self.decodes + sum(self.prefills)


@dataclass(frozen=True)
class Variant:
    """One compiled form of a kernel: what triton's cache key is made of, in a hashable form."""

    kernel: str  # "module:name" of the @triton.jit function
    signature: tuple[tuple[str, str], ...]  # parameter -> "*bf16", "i32", "constexpr", ...
    constexprs: tuple[tuple[tuple[int, ...], Any], ...]  # argument path -> value
    attrs: tuple[
        tuple[tuple[int, ...], tuple[tuple[str, int], ...]], ...
    ]  # path -> (("tt.divisibility", 16),)
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        return self.kernel.rsplit(":", 1)[1]

    @property
    def sixteen_bit(self) -> bool:
        """Whether it reads or writes 16-bit tensors (bf16/fp16): those must not spill."""
        return any(t in ("*bf16", "*fp16") for _, t in self.signature)

    def describe(self) -> str:
        names = [n for n, _ in self.signature]
        consts = ", ".join(f"{names[p[0]]}={_plain(v)}" for p, v in self.constexprs)
        dtypes = sorted(
            {t[1:] for _, t in self.signature if t.startswith("*") and t[1:] in ("bf16", "fp16", "fp32")}
        )
        return f"{self.name}[{'/'.join(dtypes)}] {consts} warps={self.num_warps} stages={self.num_stages}"


def _plain(value: Any) -> Any:
    """A constexpr value as JSON can hold it (tl.dtype -> its name)."""
    return value if isinstance(value, bool | int | float | str) or value is None else str(value)


# ---------------------------------------------------------------- 1. record


OnLaunch = Callable[[Any, tuple[Any, ...], dict[str, Any], Any], None]  # (JITFunction, args, kwargs, grid)


@contextlib.contextmanager
def capture(on_launch: OnLaunch) -> Iterator[None]:
    """Every `kernel[grid](...)` inside the block calls `on_launch` instead of launching."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        on_launch(self, args, kwargs, grid)

    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = original


class Recorder:
    """Turns launches into Variants, bound and specialized as triton binds a launch on a CUDA GPU."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        # Argument specialization is the same for every CUDA arch: record once, compile for each.
        self._backend = make_backend(GPUTarget("cuda", 90, 32))
        self._binders: dict[int, Any] = {}
        self._seen: set[tuple[int, str, str]] = set()
        self.variants: dict[Variant, None] = {}  # insertion-ordered set

    def __call__(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], grid: Any) -> None:
        from triton import knobs
        from triton.runtime.jit import create_function_from_signature

        kwargs = dict(kwargs)
        # As JITFunction.run fills them before binding, so the options match a real launch's.
        kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
        binder = self._binders.get(id(fn))
        if binder is None:
            binder = self._binders[id(fn)] = create_function_from_signature(
                fn.signature, fn.params, self._backend
            )
        bound, specialization, options = binder(*args, **kwargs)
        seen = (id(fn), repr(specialization), repr(sorted(options.items())))
        if seen in self._seen:  # the same variant again: packing it is most of the cost
            return
        self._seen.add(seen)
        options, signature, constexprs, attrs = fn._pack_args(
            self._backend, kwargs, bound, specialization, options
        )
        variant = Variant(
            kernel=f"{fn.fn.__module__}:{fn.fn.__name__}",
            signature=tuple(signature.items()),
            constexprs=tuple(sorted(constexprs.items())),
            attrs=tuple(sorted((k, tuple(tuple(a) for a in v)) for k, v in attrs.items() if v)),
            num_warps=options.num_warps,
            num_stages=options.num_stages,
        )
        self.variants.setdefault(variant, None)


@dataclass
class _Request:
    pages: list[int]
    adapter: str | None

    def tokens(self, start: int, end: int) -> list[int]:
        return [1] * (end - start)


@dataclass
class _Chunk:
    request: _Request
    start: int
    num_tokens: int
    samples: bool = True

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


def _chunks(step: StepShape) -> list[_Chunk]:
    """Decodes (one token at the end of `context`) then fresh prefill chunks, each on its own pages."""
    chunks: list[_Chunk] = []
    next_page = 1  # page 0 is the pool's zero page
    lengths = [(step.context - 1, 1)] * step.decodes + [(0, n) for n in step.prefills]
    for i, (start, n) in enumerate(lengths):
        pages = -(-(start + n) // step.page_size)
        adapter = f"adapter-{i % step.adapters}" if step.rank else None
        chunks.append(_Chunk(_Request(list(range(next_page, next_page + pages)), adapter), start, n))
        next_page += pages
    return chunks


def _lora_tables(step: StepShape, names: Sequence[str], layers: int) -> dict[str, Any]:
    """Every group's tables for `names`, all of rank step.rank, as meta tensors (shapes are all the
    kernels see of them). They say a DoRA adapter is among them, so the DoRA scale kernels
    (kernels/lora_dora.py) are recorded at every LoRA step too; the other launches are the same."""
    from .lora.tables import LoraTables

    meta = torch.device("meta")
    rows = step.rank * len(names)
    table = LoraTables(
        a_starts=torch.empty(layers, rows, dtype=torch.int64, device=meta),
        b_starts=torch.empty(layers, rows, dtype=torch.int64, device=meta),
        b_cols=torch.empty(layers, rows, dtype=torch.int32, device=meta),
        b_widths=torch.empty(layers, rows, dtype=torch.int32, device=meta),
        slot_start=torch.empty(len(names), dtype=torch.int32, device=meta),
        slot_rank=torch.empty(len(names), dtype=torch.int32, device=meta),
        max_rank=step.rank,
        d_starts=torch.empty(layers, rows, dtype=torch.int64, device=meta),
        dora=True,
    )
    return {group: table for group in ("qkv", "o", "gate_up", "down")}


def _drive_step(step: StepShape) -> None:
    """The runner's work for one step (engine/runner.py: build, attention, LoRA step, model), on meta."""
    from .attention import TritonAttention
    from .batch import BatchBuilder
    from .lora.step import KernelLoraStep

    meta = torch.device("meta")
    config = replace(step.config, num_layers=RECORD_LAYERS)
    chunks = _chunks(step)
    batch = BatchBuilder(step.page_size, meta).build(chunks)
    pages = 1 + sum(len(c.request.pages) for c in chunks)
    c = config
    memory = torch.empty(
        pages, c.num_layers, 2, c.num_kv_heads, step.page_size, c.head_dim, dtype=step.dtype, device=meta
    )
    attention = TritonAttention(memory, batch, c.head_dim**-0.5)
    lora = None
    if batch.lora is not None:
        pool_rows = torch.empty(1 << 16, c.head_dim, dtype=step.dtype, device=meta)
        tables = _lora_tables(step, batch.lora.adapters, c.num_layers)
        lora = KernelLoraStep(
            pool_rows, tables, batch.num_decodes, batch.lora.decode_slots, batch.lora.segments
        )
    if step.context + max(step.prefills, default=0) > RECORD_POSITIONS:
        raise ValueError(f"{step} reaches past the recorded model's {RECORD_POSITIONS} positions")
    model = _meta_model(config, step.dtype)
    with torch.inference_mode():
        model(batch.input_ids, batch.positions, attention, batch.logits_indices, lora)


@functools.lru_cache(maxsize=8)
def _meta_model(config: ModelConfig, dtype: torch.dtype) -> Any:
    """The model on meta, built once per shape: its rotary tables are computed on the CPU, which
    costs more than driving a step."""
    from .model.llama import LlamaModel

    return LlamaModel(config, dtype, "meta", max_positions=RECORD_POSITIONS)


# Every driver is called at every StepShape; see "Adding a kernel" above.
def _drive_quant(step: StepShape) -> None:
    """The weight-only GEMMs of quantized base models at `step.tokens` rows on every projection of
    `step.config` (int8, and int4 at each group size the loaders make), on meta tensors."""
    from .kernels.quant_matmul import w4a16_matmul, w8a16_matmul
    from .model.quant import QuantizedWeight
    from .model.quant_formats import INT4_GROUP_SIZES

    meta = torch.device("meta")
    c = step.config
    head_dim = c.head_dim
    shapes = {
        ((c.num_heads + 2 * c.num_kv_heads) * head_dim, c.hidden_size),  # fused qkv
        (c.hidden_size, c.num_heads * head_dim),  # o
        (2 * c.intermediate_size, c.hidden_size),  # fused gate_up
        (c.hidden_size, c.intermediate_size),  # down
        (c.vocab_size, c.hidden_size),  # lm_head
    }
    x_of = {k: torch.empty(step.tokens, k, dtype=step.dtype, device=meta) for _, k in shapes}
    for n, k in sorted(shapes):
        q8 = torch.empty(n, k, dtype=torch.int8, device=meta)
        w8a16_matmul(
            x_of[k], QuantizedWeight("int8", q8, torch.empty(n, dtype=step.dtype, device=meta), None, k, n, k)
        )
        for g in INT4_GROUP_SIZES:
            if k % g:
                continue
            q4 = torch.empty(n, k // 2, dtype=torch.uint8, device=meta)
            meta_g = torch.empty(n, k // g, dtype=step.dtype, device=meta)
            w4a16_matmul(x_of[k], QuantizedWeight("int4", q4, meta_g, meta_g, g, n, k))


DRIVERS: list[Callable[[StepShape], None]] = [_drive_step, _drive_quant]


def record_variants(steps: Iterable[StepShape], target: GpuTarget) -> list[Variant]:
    """The distinct variants the engine launches over `steps` on `target`, in first-launch order."""
    recorder = Recorder()
    with targeting(target), capture(recorder):
        for step in steps:
            for drive in DRIVERS:
                drive(step)
    return list(recorder.variants)


# Batch sizes where the wrappers' choices can change: powers of two cover the block-size thresholds
# (16/32/64-row tiles, ranks' next power of two), and the grid-fill decisions (split-K, decode
# partitions) change with batch * heads against the SM count, which they straddle for every model.
GATE_BATCHES = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256)
GATE_RANKS = (4, 8, 16, 32, 64)  # every shrink/expand block choice: ranks 1-4, 8, 16, 32, 64 and up
GATE_CONTEXTS = (200, 4000)  # below and above where decode attention would split
# Prefill chunk mixes: one short chunk (16-row LoRA tiles), one of 17-32 rows, several chunks with
# a long one, and decodes beside prefills.
GATE_PREFILLS = ((7,), (30,), (300, 40, 9), (1024,))


def gate_shapes(
    config: ModelConfig, dtype: torch.dtype, max_batch: int = 256, page_size: int = 16
) -> list[StepShape]:
    """The steps the gate records for one model and dtype (and warm-up for an engine's, whose batch
    limit is max_batch)."""
    batches = sorted({b for b in GATE_BATCHES if b <= max_batch} | {max_batch})
    steps = []
    for batch in batches:
        for i, rank in enumerate((0, *GATE_RANKS)):
            context = GATE_CONTEXTS[i % len(GATE_CONTEXTS)]
            steps.append(StepShape(config, dtype, batch, context, (), rank, page_size))
    for i, rank in enumerate((0, *GATE_RANKS)):
        for prefills in GATE_PREFILLS:
            steps.append(StepShape(config, dtype, 0, 1, prefills, rank, page_size))
        mixed = GATE_PREFILLS[i % len(GATE_PREFILLS)]
        steps.append(StepShape(config, dtype, min(8, max_batch), 300, mixed, rank, page_size))
    return steps


# ---------------------------------------------------------------- 2. compile


@dataclass
class Report:
    kernel: str
    variant: str  # Variant.describe()
    arch: int
    sixteen_bit: bool
    registers: int = 0
    spill_stores: int = 0  # bytes
    spill_loads: int = 0
    error: str = ""
    seconds: float = 0.0
    cached: bool = field(default=False, compare=False)

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


def cache_dir() -> Path:
    return Path(os.environ.get("LORAPLEX_AOT_CACHE") or Path.home() / ".cache" / "loraplex" / "aot")


def _function(kernel: str) -> Any:
    module, name = kernel.split(":")
    return getattr(importlib.import_module(module), name)


def cache_key(variant: Variant, arch: int) -> str:
    import triton

    source = _function(variant.kernel).cache_key  # hash of the kernel's source and what it calls
    text = repr((triton.__version__, source, variant, arch))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


_PTXAS_USAGE = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _usage(log: str) -> tuple[int, int, int]:
    registers = _PTXAS_USAGE.search(log)
    spills = _PTXAS_SPILLS.search(log)
    if registers is None or spills is None:
        raise RuntimeError(f"no register usage in ptxas' log:\n{log}")
    return int(registers.group(1)), int(spills.group(1)), int(spills.group(2))


def _ptxas_log(ptx: str, arch: int) -> str:
    """`ptxas -v` of the triton wheel on `ptx`: for a kernel triton had cached (it compiled silently)."""
    from triton.backends.nvidia.compiler import get_ptxas

    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}{suffix}", str(src), "-o", str(src) + ".o"]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stderr


def compile_variant(variant: Variant, arch: int) -> Report:
    """Compile one variant for sm_<arch> with no GPU present; registers and spills from ptxas -v."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    report = Report(variant.kernel, variant.describe(), arch, variant.sixteen_bit)
    began = time.perf_counter()
    fn = _function(variant.kernel)
    attrs = {path: [list(a) for a in values] for path, values in variant.attrs}
    source = ASTSource(fn, dict(variant.signature), dict(variant.constexprs), attrs)
    log = io.StringIO()
    knobs.nvidia.dump_ptxas_log = True  # triton prints ptxas' -v log when it runs ptxas itself
    try:
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(
                source,
                target=GPUTarget("cuda", arch, 32),
                options={"num_warps": variant.num_warps, "num_stages": variant.num_stages},
            )
        text = log.getvalue()
        if "registers" not in text:
            text = _ptxas_log(kernel.asm["ptx"], arch)
        report.registers, report.spill_stores, report.spill_loads = _usage(text)
    except Exception as error:
        report.error = f"{type(error).__name__}: {error}"[:2000]
    report.seconds = round(time.perf_counter() - began, 3)
    return report


def _worker_init() -> None:
    # Triton 3.9 warns when this is unset; fusion on is what triton 3.6 (the GPU machines) does.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def compile_all(jobs: Sequence[tuple[Variant, int]], workers: int = 2) -> list[Report]:
    """Reports for every (variant, arch), from the cache where it has them, compiled in a pool if not."""
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    reports: list[Report | None] = [None] * len(jobs)
    todo = []
    for i, (variant, arch) in enumerate(jobs):
        path = directory / f"{cache_key(variant, arch)}.json"
        if path.exists():
            reports[i] = Report(**{**json.loads(path.read_text()), "cached": True})
        else:
            todo.append((i, path))
    if todo:
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # torch and triton in the parent: no fork
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_init) as pool:
            futures = [(i, path, pool.submit(compile_variant, *jobs[i])) for i, path in todo]
            for i, path, future in futures:
                report = future.result()
                reports[i] = report
                if not report.error:  # errors are not cached: a fixed toolchain gets another try
                    path.write_text(json.dumps({k: v for k, v in asdict(report).items() if k != "cached"}))
    return [r for r in reports if r is not None]


# ---------------------------------------------------------------- 3. judge


def gate_jobs(
    models: Sequence[str], dtypes: Sequence[torch.dtype], targets: Sequence[GpuTarget]
) -> list[tuple[Variant, int]]:
    jobs: dict[tuple[Variant, int], None] = {}
    for target in targets:
        for model in models:
            for dtype in dtypes:
                for variant in record_variants(gate_shapes(MODELS[model], dtype), target):
                    jobs.setdefault((variant, target.arch), None)
    return list(jobs)


def overridden(variant: Variant, name: str, value: int) -> Variant:
    """`variant` with constexpr (or num_warps / num_stages) `name` set to `value`, if it has it."""
    if name == "num_warps":
        return replace(variant, num_warps=value)
    if name == "num_stages":
        return replace(variant, num_stages=value)
    names = [n for n, _ in variant.signature]
    if name not in names or (names.index(name),) not in dict(variant.constexprs):
        return variant
    constexprs = dict(variant.constexprs) | {(names.index(name),): value}
    return replace(variant, constexprs=tuple(sorted(constexprs.items())))


def failures(reports: Iterable[Report]) -> list[str]:
    """What fails the gate: compile errors, and spills in 16-bit variants."""
    bad = []
    for r in reports:
        if r.error:
            bad.append(f"sm_{r.arch} {r.variant}: {r.error}")
        elif r.sixteen_bit and r.spills:
            bad.append(f"sm_{r.arch} {r.variant}: spills {r.spill_stores} B stores / {r.spill_loads} B loads")
    return bad


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loraplex.engine.aot", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated keys of MODELS")
    parser.add_argument("--dtypes", default="bfloat16,float16,float32")
    parser.add_argument("--archs", default="80,90", help="compute capabilities: 80 (A100), 90 (H100)")
    parser.add_argument("--kernels", default="", help="comma-separated kernel names to keep (default: all)")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="NAME=INT",
        help="compile with this constexpr, num_warps or num_stages changed wherever a variant has it "
        "(what a tile or a hint would cost: COL_ALIGN=1, BLOCK_M=32, num_warps=8); repeatable",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write every report here")
    parser.add_argument("--list", action="store_true", help="print the variants and stop (no compiling)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled for a GPU")
    targets = [t for t in TARGETS if str(t.arch) in args.archs.split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    began = time.perf_counter()
    jobs = gate_jobs(args.models.split(","), dtypes, targets)
    if args.kernels:
        jobs = [(v, arch) for v, arch in jobs if v.name in args.kernels.split(",")]
    for override in args.override:
        name, _, value = override.partition("=")
        jobs = list(dict.fromkeys((overridden(v, name, int(value)), arch) for v, arch in jobs))
    recorded = time.perf_counter() - began
    if args.list:
        for variant, arch in jobs:
            print(f"sm_{arch} {variant.describe()}")
        return 0
    reports = compile_all(jobs, args.workers)
    seconds = time.perf_counter() - began
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in reports], indent=1))
    kernels = sorted({r.kernel for r in reports})
    print(
        f"{len(reports)} variants of {len(kernels)} kernels for "
        f"{', '.join(f'sm_{t.arch}' for t in targets)}; "
        f"recorded in {recorded:.1f} s, {sum(not r.cached for r in reports)} compiled, total {seconds:.1f} s"
    )
    for kernel in kernels:
        for target in targets:
            mine = [r for r in reports if r.kernel == kernel and r.arch == target.arch and not r.error]
            if mine:
                regs = [r.registers for r in mine]
                spilling = sum(r.spills for r in mine)
                print(
                    f"  sm_{target.arch} {kernel.rsplit(':', 1)[1]}: {len(mine)} variants, registers "
                    f"{min(regs)}-{max(regs)} (mean {sum(regs) / len(regs):.0f}), {spilling} spill"
                )
    fp32_spills = [r for r in reports if r.spills and not r.sixteen_bit]
    for r in fp32_spills:
        print(f"  float32 spill (allowed): sm_{r.arch} {r.variant}: {r.spill_stores} B")
    bad = failures(reports)
    for line in bad:
        print(f"FAIL {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
