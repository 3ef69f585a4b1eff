"""How many rows one program of the fused row-wise kernels (RMSNorm, SiLU·mul, rotary) handles.

On a GPU a row per program fills the machine and keeps a program's registers small. Triton's CPU
interpreter runs programs one after another in Python, where each costs milliseconds whatever its size,
so there a program takes as many rows as fit in a tile of 64k elements. Chosen from shapes and the
device only, never from tensor values, so the grid of a decode step is fixed per batch size. A `meta`
device inside `gpu.targeting` counts as the GPU: the ahead-of-time gate and the warm-up record the GPU's
tiling.
"""

from __future__ import annotations

import torch
import triton

from .gpu import gpu_target

INTERPRETER_TILE = 1 << 16  # elements per program under the interpreter


def rows_per_program(device: torch.device, rows: int, width: int, gpu_rows: int = 1) -> int:
    """A power of two: `gpu_rows` on CUDA; under the interpreter, all rows up to the tile limit."""
    # Asking gpu_target on CUDA would query the device on every launch; the type is enough there.
    if device.type == "cuda" or (device.type == "meta" and gpu_target(device) is not None):
        return gpu_rows
    return max(
        1, min(triton.next_power_of_2(max(rows, 1)), INTERPRETER_TILE // triton.next_power_of_2(width))
    )
