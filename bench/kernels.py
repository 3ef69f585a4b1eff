"""`python -m loraplex.bench kernels`: the Triton kernels alone, against their floors and a torch baseline.

Cases, at Llama-7B shapes (hidden 4096, 32 heads of 128; `--small`: tiny shapes for the CPU):

- lora-decode: multi-adapter LoRA shrink + expand of one token per sequence (BGMV-style, per-token
  slots) on a hidden -> hidden projection, adapters of mixed ranks scattered row by row in a pool;
- lora-prefill: the same over segments of `--prefill-len` tokens per sequence (SGMV-style);
- attention-decode: paged decode attention, GQA with 32 and 8 kv heads.

Adapter popularity is `distinct` (every sequence its own adapter) or `zipf` (alpha 1 over as many adapters
as sequences). For every case the two floors are counted before timing: FLOPs, and bytes moved (adapter
rows read once per distinct adapter, activations read and written, the cached keys and values read).
Every timed kernel's output is checked once against the torch reference (`engine/kernels/reference.py`)
before it is timed. Timing: CUDA events on a GPU, time.perf_counter on the CPU, median of `--repeats`
after `--warmup`. The fraction of bandwidth is of a large device-to-device copy measured in the same run.
The LoRA baseline is S-LoRA's bmm ablation: gather each token's A and B, zero-padded to the largest rank,
from stacked weights into [T, r_max, in] / [T, r_max, out] and bmm; the attention baseline is the torch
reference (gather the pages, then matmul).

On the CPU the kernels run in Triton's interpreter: those timings are NOT performance figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

LLAMA_7B = {"hidden": 4096, "heads": 32, "head_dim": 128, "kv_heads": (32, 8), "ranks": (8, 16, 32, 64)}
SMALL = {"hidden": 256, "heads": 4, "head_dim": 64, "kv_heads": (4, 2), "ranks": (2, 4, 8)}
FULL_BATCHES = "1,8,32,64,128,256"
SMALL_BATCHES = "1,8"
POPULARITIES = ("distinct", "zipf")
PAGE_SIZE = 16
INTERPRETER_NOTE = (
    "NOTE: device cpu: the Triton kernels ran in Triton's CPU interpreter; "
    "these timings are NOT performance figures (they only show the harness works)."
)


@dataclass
class CaseResult:
    case: str  # lora-decode / lora-prefill / attention-decode
    variant: str  # popularity, or kv heads
    batch: int  # sequences
    tokens: int  # tokens the kernel processes
    flops: int
    bytes_moved: int
    kernel_seconds: float
    checked: bool  # the kernel's output matched the torch reference before timing
    baseline: str
    baseline_seconds: float | None  # None: the baseline would not fit in memory
    baseline_checked: bool
    copy_bandwidth: float  # bytes/s of the device's large copy, read + written

    @property
    def bytes_per_second(self) -> float:
        return self.bytes_moved / self.kernel_seconds

    @property
    def bandwidth_fraction(self) -> float:
        return self.bytes_per_second / self.copy_bandwidth

    @property
    def speedup(self) -> float | None:
        return None if self.baseline_seconds is None else self.baseline_seconds / self.kernel_seconds


@dataclass
class Report:
    device: str
    dtype: str
    interpreted: bool
    copy_bandwidth: float
    shapes: dict[str, object]
    results: list[CaseResult] = field(default_factory=list)


# -- timing ---------------------------------------------------------------------------------------------


def median_seconds(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median of `repeats` timed calls after `warmup` untimed ones (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, mebibytes: int) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(mebibytes * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, warmup=2, repeats=5)
    return 2 * src.numel() * 4 / seconds


def assert_near(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, loose: float = 1.0) -> None:
    """float32: summation order only; 16-bit: about one ulp of the result, relative to its largest entry."""
    scale = float(expected.float().abs().max()) or 1.0
    if dtype == torch.float32:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=1e-4, atol=1e-4 * loose * scale)
    else:
        tol = 1e-2 * loose
        torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol * scale)


# -- LoRA -----------------------------------------------------------------------------------------------


@dataclass
class LoraSetup:
    """Adapters' A and scaled B^T rows scattered row by row over a pool, with the kernels' tables, and the
    same weights stacked and zero-padded to the largest rank for the baseline."""

    pool_rows: torch.Tensor  # [N, head_dim]
    a_starts: torch.Tensor  # [C] int64
    b_starts: torch.Tensor  # [C] int64
    b_cols: torch.Tensor  # [C] int32
    b_widths: torch.Tensor  # [C] int32
    slot_start: torch.Tensor  # [S] int32
    slot_rank: torch.Tensor  # [S] int32
    ranks: list[int]
    a_stack: torch.Tensor  # [S, r_max, in]
    b_stack: torch.Tensor  # [S, r_max, out]


def lora_setup(
    ranks: list[int], hidden: int, head_dim: int, dtype: torch.dtype, device: torch.device, seed: int
) -> LoraSetup:
    if hidden % head_dim:
        raise ValueError(f"hidden {hidden} must be a multiple of the pool row width {head_dim}")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    chunk = hidden // head_dim  # pool rows per matrix row (A and B^T rows are both `hidden` wide)
    total = sum(ranks)
    a_dense = torch.randn(total, hidden, generator=generator) / hidden**0.5
    b_dense = torch.cat([torch.randn(r, hidden, generator=generator) / r**0.5 for r in ranks])
    # Every matrix row at a random place in the pool; the first chunk stays the zero row.
    place = torch.randperm(2 * total, generator=generator) + 1
    pool = torch.zeros(2 * total + 1, hidden)
    pool[place] = torch.cat([a_dense, b_dense])
    r_max = max(ranks)
    a_stack = torch.zeros(len(ranks), r_max, hidden)
    b_stack = torch.zeros(len(ranks), r_max, hidden)
    starts = [0]
    for u, r in enumerate(ranks):
        a_stack[u, :r] = a_dense[starts[-1] : starts[-1] + r]
        b_stack[u, :r] = b_dense[starts[-1] : starts[-1] + r]
        starts.append(starts[-1] + r)

    def ints(values: torch.Tensor | list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(values).to(device=device, dtype=dtype)

    return LoraSetup(
        pool_rows=pool.view(-1, head_dim).to(device, dtype).contiguous(),
        a_starts=ints(place[:total] * chunk, torch.long),
        b_starts=ints(place[total:] * chunk, torch.long),
        b_cols=ints(torch.zeros(total), torch.int32),
        b_widths=ints(torch.full((total,), hidden), torch.int32),
        slot_start=ints(starts[:-1], torch.int32),
        slot_rank=ints(ranks, torch.int32),
        ranks=ranks,
        a_stack=a_stack.to(device, dtype),
        b_stack=b_stack.to(device, dtype),
    )


def choose_slots(popularity: str, count: int, rng: random.Random) -> list[int]:
    """Adapter slot of each of `count` sequences, over `count` adapters."""
    if popularity == "distinct":
        return rng.sample(range(count), count)
    if popularity == "zipf":  # alpha = 1
        return rng.choices(range(count), [1.0 / (k + 1) for k in range(count)], k=count)
    raise ValueError(popularity)


def lora_floors(setup: LoraSetup, token_slot: list[int], hidden: int, element: int) -> tuple[int, int]:
    """(FLOPs, bytes): each token's own rank in shrink and expand; each used adapter's rows read once,
    x read, y read and written, the float32 shrunk activations written and read back."""
    flops = sum(2 * setup.ranks[u] * (hidden + hidden) for u in token_slot)
    weights = sum(setup.ranks[u] * 2 * hidden for u in set(token_slot)) * element
    tokens, r_max = len(token_slot), max(setup.ranks)
    activations = tokens * hidden * element * 3 + tokens * r_max * 4 * 2
    return flops, weights + activations


def bmm_baseline(setup: LoraSetup, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor) -> None:
    """S-LoRA's bmm ablation: every token's A and B, padded to the largest rank, gathered, then bmm."""
    a = setup.a_stack.index_select(0, slots)  # [T, r_max, in]
    b = setup.b_stack.index_select(0, slots)  # [T, r_max, out]
    shrunk = torch.bmm(a, x.unsqueeze(2))  # [T, r_max, 1]
    y.add_(torch.bmm(shrunk.transpose(1, 2), b).squeeze(1))


def lora_case(
    mode: str,
    popularity: str,
    batch: int,
    shapes: dict[str, object],
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    bandwidth: float,
) -> CaseResult:
    from loraplex.engine.kernels import lora_expand, lora_shrink, reference
    from loraplex.engine.kernels.lora_meta import LoRAKernelMeta

    hidden, head_dim = int(shapes["hidden"]), int(shapes["head_dim"])  # type: ignore[call-overload]
    rank_choices: tuple[int, ...] = shapes["ranks"]  # type: ignore[assignment]
    rng = random.Random(f"{args.seed}-{mode}-{popularity}-{batch}")
    ranks = [rng.choice(rank_choices) for _ in range(batch)]
    setup = lora_setup(ranks, hidden, head_dim, dtype, device, rng.randrange(2**31))
    seq_slots = choose_slots(popularity, batch, rng)
    per_seq = 1 if mode == "decode" else args.prefill_len
    token_slot = [u for u in seq_slots for _ in range(per_seq)]
    tokens = len(token_slot)
    generator = torch.Generator(device=device).manual_seed(rng.randrange(2**31))
    x = torch.randn(tokens, hidden, generator=generator, device=device, dtype=dtype)
    y0 = torch.randn(tokens, hidden, generator=generator, device=device, dtype=dtype)
    slots = torch.tensor(token_slot, dtype=torch.int32, device=device)
    seg_starts = torch.arange(0, tokens + 1, per_seq, dtype=torch.int32, device=device)
    seg_slot = torch.tensor(seq_slots, dtype=torch.int32, device=device)
    r_max = max(ranks)
    s = setup

    meta = LoRAKernelMeta(
        s.a_starts[None],  # one layer
        s.b_starts[None],
        s.b_cols[None],
        s.b_widths[None],
        s.slot_start,
        s.slot_rank,
        max_rank=r_max,
        token_slot=slots if mode == "decode" else None,
        seg_starts=None if mode == "decode" else seg_starts,
        seg_slot=None if mode == "decode" else seg_slot,
        max_seg_len=per_seq,
    )

    def kernel(y: torch.Tensor) -> None:
        if mode == "decode":
            shrunk = lora_shrink.lora_shrink_tokens(x, s.pool_rows, meta, 0)
            lora_expand.lora_expand_tokens(y, shrunk, s.pool_rows, meta, 0)
        else:
            shrunk = lora_shrink.lora_shrink_segments(x, s.pool_rows, meta, 0)
            lora_expand.lora_expand_segments(y, shrunk, s.pool_rows, meta, 0)

    # The oracle: the torch reference of the same shrink and expand.
    expected = y0.clone()
    tokens_meta = replace(meta, token_slot=slots)
    shrunk_ref = reference.lora_shrink_tokens(x, s.pool_rows, tokens_meta, 0)
    reference.lora_expand_tokens(expected, shrunk_ref, s.pool_rows, tokens_meta, 0)
    actual = y0.clone()
    kernel(actual)
    assert_near(actual, expected, dtype)  # the delta is about as large as y0: an error in it shows
    checked = True

    element = x.element_size()
    flops, bytes_moved = lora_floors(s, token_slot, hidden, element)
    log(args, f"  lora-{mode} {popularity} batch {batch}: {flops:.3e} FLOPs, {bytes_moved:.3e} bytes")
    y = y0.clone()
    kernel_seconds = median_seconds(lambda: kernel(y), device, args.warmup, args.repeats)

    slots_long = slots.long()
    gathered = 2 * tokens * r_max * hidden * element
    baseline_seconds, baseline_checked = None, False
    if gathered <= args.baseline_max_gib * 2**30:
        actual = y0.clone()
        bmm_baseline(s, x, actual, slots_long)
        assert_near(actual, expected, dtype, loose=2.0)  # 16-bit: shrunk rounded before expand
        baseline_checked = True
        y = y0.clone()
        baseline_seconds = median_seconds(
            lambda: bmm_baseline(s, x, y, slots_long), device, args.warmup, args.repeats
        )
    return CaseResult(
        case=f"lora-{mode}",
        variant=popularity,
        batch=batch,
        tokens=tokens,
        flops=flops,
        bytes_moved=bytes_moved,
        kernel_seconds=kernel_seconds,
        checked=checked,
        baseline="gather+bmm (padded)",
        baseline_seconds=baseline_seconds,
        baseline_checked=baseline_checked,
        copy_bandwidth=bandwidth,
    )


# -- attention ------------------------------------------------------------------------------------------


def attention_case(
    kv_heads: int,
    batch: int,
    shapes: dict[str, object],
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    bandwidth: float,
) -> CaseResult:
    from loraplex.engine.kernels import paged_decode_attention, reference

    heads, head_dim = int(shapes["heads"]), int(shapes["head_dim"])  # type: ignore[call-overload]
    rng = random.Random(f"{args.seed}-attention-{kv_heads}-{batch}")
    # Contexts between half and all of --context tokens; pages scattered over the pool.
    lens = [rng.randint(max(1, args.context // 2), args.context) for _ in range(batch)]
    blocks = -(-args.context // PAGE_SIZE)
    generator = torch.Generator(device=device).manual_seed(rng.randrange(2**31))
    num_pages = batch * blocks + 1
    memory = torch.randn(
        num_pages, 1, 2, kv_heads, PAGE_SIZE, head_dim, generator=generator, device=device, dtype=dtype
    )
    tables = (torch.randperm(num_pages - 1, generator=generator, device=device) + 1).view(batch, blocks)
    context_lens = torch.tensor(lens, dtype=torch.long, device=device)
    q = torch.randn(batch, heads, head_dim, generator=generator, device=device, dtype=dtype)
    scale = head_dim**-0.5

    def kernel() -> torch.Tensor:
        return paged_decode_attention.paged_decode_attention(q, memory, 0, tables, context_lens, scale)

    def baseline() -> torch.Tensor:
        return reference.paged_decode_attention(q, memory, 0, tables, context_lens, scale)

    expected = baseline()
    assert_near(kernel(), expected, dtype)
    checked = True

    element = q.element_size()
    flops = 4 * heads * head_dim * sum(lens)  # q.K^T and P.V
    # Every cached key and value once, q read, out written, the block tables read.
    bytes_moved = 2 * kv_heads * head_dim * sum(lens) * element + 2 * q.numel() * element
    bytes_moved += tables.numel() * tables.element_size() + context_lens.numel() * 8
    log(args, f"  attention-decode kv{kv_heads} batch {batch}: {flops:.3e} FLOPs, {bytes_moved:.3e} bytes")
    kernel_seconds = median_seconds(kernel, device, args.warmup, args.repeats)
    baseline_seconds = median_seconds(baseline, device, args.warmup, args.repeats)
    return CaseResult(
        case="attention-decode",
        variant=f"kv_heads={kv_heads}",
        batch=batch,
        tokens=batch,
        flops=flops,
        bytes_moved=bytes_moved,
        kernel_seconds=kernel_seconds,
        checked=checked,
        baseline="torch reference (gather pages + matmul)",
        baseline_seconds=baseline_seconds,
        baseline_checked=True,  # it is the reference the kernel was checked against
        copy_bandwidth=bandwidth,
    )


# -- running and printing -------------------------------------------------------------------------------


def log(args: argparse.Namespace, line: str = "") -> None:
    """Progress and notes: on stdout with the table, on stderr with --json (stdout is then pure JSON)."""
    print(line, file=sys.stderr if args.json else sys.stdout, flush=True)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    return torch.device(name)


def prepare_triton(device: torch.device) -> bool:
    """On the CPU the kernels need Triton's interpreter, chosen when their modules are first imported.
    Returns whether the kernels run interpreted."""
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from loraplex.engine.kernels import lora_shrink  # noqa: F401  (decorates the kernels now)
    from loraplex.engine.kernels.dot import interpreting

    interpreted = interpreting()
    if device.type == "cpu" and not interpreted:
        raise SystemExit("--device cpu needs TRITON_INTERPRET=1 before triton is first imported")
    return interpreted


def run_benchmarks(args: argparse.Namespace) -> Report:
    device = resolve_device(args.device)
    interpreted = prepare_triton(device)
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    shapes: dict[str, object] = dict(SMALL if args.small else LLAMA_7B)
    if args.batch_sizes is None:
        args.batch_sizes = SMALL_BATCHES if args.small else FULL_BATCHES
    if args.prefill_len is None:
        args.prefill_len = 4 if args.small else 128
    if args.context is None:
        args.context = 32 if args.small else 1024
    if args.repeats is None:
        args.repeats = 3 if device.type == "cpu" else 50
    if args.warmup is None:
        args.warmup = 1 if device.type == "cpu" else 10
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if interpreted:
        log(args, INTERPRETER_NOTE)
    log(args, f"kernel benchmark on {device} ({dtype}), shapes {shapes}")
    bandwidth = copy_bandwidth(device, args.copy_mib or (64 if args.small else 1024))
    log(args, f"device copy bandwidth (read + write): {bandwidth / 1e9:.1f} GB/s")
    report = Report(str(device), str(dtype).removeprefix("torch."), interpreted, bandwidth, shapes)
    cases = set(args.cases.split(","))
    for mode in ("decode", "prefill"):
        if f"lora-{mode}" in cases:
            for popularity in POPULARITIES:
                for batch in batches:
                    report.results.append(
                        lora_case(mode, popularity, batch, shapes, args, device, dtype, bandwidth)
                    )
    if "attention-decode" in cases:
        for kv_heads in shapes["kv_heads"]:  # type: ignore[attr-defined]
            for batch in batches:
                report.results.append(attention_case(kv_heads, batch, shapes, args, device, dtype, bandwidth))
    log(args)
    if args.json:
        print(json.dumps(as_json(report), indent=2))
    else:
        print(markdown_table(report))
    if interpreted:
        log(args, INTERPRETER_NOTE)
    return report


def as_json(report: Report) -> dict[str, object]:
    document = asdict(report)
    for row, result in zip(document["results"], report.results, strict=True):
        row.update(
            bytes_per_second=result.bytes_per_second,
            bandwidth_fraction=result.bandwidth_fraction,
            speedup=result.speedup,
        )
    document["note"] = INTERPRETER_NOTE if report.interpreted else ""
    return document


def _microseconds(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e6:,.1f}"


def markdown_table(report: Report) -> str:
    lines = [
        "| case | variant | batch | tokens | FLOPs | bytes moved | bytes floor µs | kernel µs | GB/s "
        "| % copy bw | baseline | baseline µs | speed-up | checked |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.results:
        speedup = "—" if r.speedup is None else f"{r.speedup:.2f}x"
        lines.append(
            f"| {r.case} | {r.variant} | {r.batch} | {r.tokens} | {r.flops:.3g} | {r.bytes_moved:.3g} "
            f"| {_microseconds(r.bytes_moved / r.copy_bandwidth)} | {_microseconds(r.kernel_seconds)} "
            f"| {r.bytes_per_second / 1e9:.2f} | {r.bandwidth_fraction:.1%} | {r.baseline} "
            f"| {_microseconds(r.baseline_seconds)} | {speedup} | {'yes' if r.checked else 'NO'} |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on CUDA, float32 on the CPU",
    )
    parser.add_argument(
        "--small", action="store_true", help="tiny shapes: the CPU interpreter finishes in seconds"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--cases", default="lora-decode,lora-prefill,attention-decode")
    parser.add_argument(
        "--batch-sizes", default=None, help=f"sequences per case ({FULL_BATCHES}; --small: {SMALL_BATCHES})"
    )
    parser.add_argument(
        "--prefill-len", type=int, default=None, help="tokens per sequence in lora-prefill (128)"
    )
    parser.add_argument(
        "--context", type=int, default=None, help="longest cached context in attention (1024)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per figure (CUDA 50, CPU 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls first (CUDA 10, CPU 1)")
    parser.add_argument(
        "--copy-mib", type=int, default=None, help="size of the bandwidth copy (1024; --small 64)"
    )
    parser.add_argument(
        "--baseline-max-gib", type=float, default=8.0, help="skip bmm baselines gathering more"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    run_benchmarks(args)
    return 0
