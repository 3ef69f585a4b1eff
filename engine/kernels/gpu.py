"""What the kernels' launch wrappers ask of the GPU they launch on: its SM count and compute capability.

The wrappers size grids and split work from these (split-K, decode partitions, tiles that fit sm_80's
registers). They ask here rather than torch.cuda directly so the ahead-of-time compiler (engine/aot.py) and
the start-up warm-up (engine/warmup.py) can drive the same wrappers with `meta` tensors while a target GPU is
named: inside `targeting(GpuTarget(...))`, a meta device answers as that GPU would. Anything else that
is not CUDA answers None (the CPU interpreter: no splits, default tiles).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GpuTarget:
    arch: int  # compute capability as an int: 80 (A100), 90 (H100)
    sms: int  # streaming multiprocessors


A100 = GpuTarget(80, 108)
H100 = GpuTarget(90, 132)

# A context variable, not a global: only code inside `targeting` sees it, and threads do not share it.
_META_TARGET: ContextVar[GpuTarget | None] = ContextVar("loraplex_meta_gpu_target", default=None)


@contextmanager
def targeting(target: GpuTarget) -> Iterator[None]:
    """Meta tensors stand for tensors on `target` while the block runs."""
    token = _META_TARGET.set(target)
    try:
        yield
    finally:
        _META_TARGET.reset(token)


def gpu_target(device: torch.device) -> GpuTarget | None:
    """The GPU a launch on `device` runs on; None off the GPU."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return GpuTarget(10 * major + minor, torch.cuda.get_device_properties(device).multi_processor_count)
    if device.type == "meta":
        return _META_TARGET.get()
    return None
