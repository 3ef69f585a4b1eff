"""Which CPU kernel runs a quantized linear at each batch size, measured once at start-up.

torch's weight-only int8/int4 kernels read 2-4x fewer bytes than a dense GEMM, so they win where a linear
is memory-bound (decode at a few tokens); a dense bf16/f32 GEMM wins once the batch is large enough to be
compute-bound. Where the crossover sits depends on the CPU, the shape and the thread count, so it is
timed here for the model's own shapes rather than guessed, and recorded on each weight
(`packed["cpu_max_quant_tokens"]`: quantized kernel up to that many tokens, dense beyond, with the dense
copy kept in `packed["dense"]`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from .quant import QuantizedWeight, cpu_weight_only_matmul, dequantize

log = logging.getLogger(__name__)

TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class Crossover:
    kind: str
    out_features: int
    in_features: int
    max_quant_tokens: int | None  # None: the quantized kernel won at every count measured
    timings_ms: tuple[tuple[int, float, float], ...]  # (tokens, quantized ms, dense ms)


def _best_ms(quant: Callable[[], object], dense: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Best time of each, their calls interleaved: a neighbour's burst (or an OpenMP barrier waiting on a
    descheduled thread, on oversubscribed cores) only ever adds time, and hits both sides alike."""
    quant(), dense()  # warm-up: packing caches, allocator, thread pool
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for side, fn in enumerate((quant, dense)):
            started = time.perf_counter()
            fn()
            best[side] = min(best[side], time.perf_counter() - started)
    return best[0] * 1e3, best[1] * 1e3


def measure(w: QuantizedWeight, dtype: torch.dtype, repeats: int = 10) -> Crossover:
    """Time the weight-only kernel against a dense GEMM on `w`'s shape at each of TOKEN_COUNTS."""
    dense = dequantize(w, dtype)
    timings = []
    limit: int | None = None
    with torch.inference_mode():
        for tokens in TOKEN_COUNTS:
            x = torch.randn(tokens, w.in_features, dtype=dtype)
            quant_fn, dense_fn = partial(cpu_weight_only_matmul, x, w), partial(F.linear, x, dense)
            quant_ms, dense_ms = _best_ms(quant_fn, dense_fn, repeats)
            if dense_ms < quant_ms:  # confirm before it decides
                again = _best_ms(quant_fn, dense_fn, repeats)
                quant_ms, dense_ms = min(quant_ms, again[0]), min(dense_ms, again[1])
            timings.append((tokens, quant_ms, dense_ms))
            if dense_ms < quant_ms:
                break
            limit = tokens
    if limit == TOKEN_COUNTS[-1]:
        limit = None
    elif limit is None:
        limit = 0  # dense won even at one token
    return Crossover(w.kind, w.out_features, w.in_features, limit, tuple(timings))


def plan_cpu_kernels(weights: Iterable[QuantizedWeight], dtype: torch.dtype) -> list[Crossover]:
    """Measure each distinct shape once, then record its crossover on every weight of that shape
    (and a dense copy where dense wins at some batch size). Returns the crossovers, for the log."""
    by_shape: dict[tuple[str, int, int, int], list[QuantizedWeight]] = {}
    for w in weights:
        by_shape.setdefault((w.kind, w.out_features, w.in_features, w.group_size), []).append(w)
    crossovers = []
    for group in by_shape.values():
        crossover = measure(group[0], dtype)
        crossovers.append(crossover)
        for w in group:
            apply_crossover(w, crossover.max_quant_tokens, dtype)
        log.info(
            "%s %dx%d: %s (quantized ms / dense ms at tokens %s)",
            crossover.kind,
            crossover.out_features,
            crossover.in_features,
            "weight-only kernel at every batch"
            if crossover.max_quant_tokens is None
            else f"weight-only kernel up to {crossover.max_quant_tokens} tokens, dense {dtype} beyond",
            ", ".join(f"{t}: {q:.3f}/{d:.3f}" for t, q, d in crossover.timings_ms),
        )
    return crossovers


def apply_crossover(w: QuantizedWeight, max_quant_tokens: int | None, dtype: torch.dtype) -> None:
    w.packed.pop("dense", None)
    w.packed.pop("cpu_max_quant_tokens", None)
    if max_quant_tokens is not None:
        w.packed["cpu_max_quant_tokens"] = max_quant_tokens
        w.packed["dense"] = dequantize(w, dtype)
