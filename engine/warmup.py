"""Compile every kernel variant an engine can launch before it serves, so no request waits on a JIT.

At start-up on CUDA, `warm_up` drives the engine's launch wrappers on `meta` tensors at the shapes
aot.gate_shapes lists for its model, dtype, page size and batch limit (the shapes the CI gate compiles
for that model), and hands every launch to triton's own `JITFunction.run(..., warmup=True)`: triton
binds and specializes it as it would the real launch, compiles it (or loads it from triton's disk
cache) into the kernel's cache on this GPU, and launches nothing. Off CUDA it returns at once: the CPU
interpreter compiles nothing.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from . import aot
from .kernels.gpu import GpuTarget, gpu_target, targeting
from .model.config import ModelConfig

log = logging.getLogger(__name__)


def warmup_shapes(
    config: ModelConfig, dtype: torch.dtype, page_size: int, max_num_seqs: int
) -> list[aot.StepShape]:
    """The steps warm-up drives: the gate's for this model and dtype, batches up to max_num_seqs."""
    return aot.gate_shapes(config, dtype, max_batch=max_num_seqs, page_size=page_size)


def variants(
    config: ModelConfig, dtype: torch.dtype, page_size: int, max_num_seqs: int, target: GpuTarget
) -> list[aot.Variant]:
    """What warm-up compiles on `target`, as the gate records it (no GPU needed)."""
    return aot.record_variants(warmup_shapes(config, dtype, page_size, max_num_seqs), target)


def warm_up(
    config: ModelConfig, dtype: torch.dtype, page_size: int, max_num_seqs: int, device: torch.device
) -> int:
    """Compile every variant on `device` if it is a GPU; returns the number of launches driven (0 off
    CUDA)."""
    target = gpu_target(device)
    if device.type != "cuda" or target is None:
        return 0
    from triton.runtime.jit import JITFunction

    run = JITFunction.run
    launches = 0

    def compile_only(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], grid: Any) -> None:
        nonlocal launches
        launches += 1
        run(fn, *args, grid=grid, warmup=True, **kwargs)

    began = time.perf_counter()
    with torch.cuda.device(device), targeting(target), aot.capture(compile_only):
        for step in warmup_shapes(config, dtype, page_size, max_num_seqs):
            for drive in aot.DRIVERS:
                drive(step)
    log.info(
        "kernel warm-up: %d launches compiled or loaded in %.1f s", launches, time.perf_counter() - began
    )
    return launches
