"""How the kernels run `tl.dot`, decided in one place for every kernel.

float32 inputs would run as tf32 on tensor cores (a 10-bit mantissa); float32 serving is for checking
results, so it asks for exact ("ieee") products. Triton's CPU interpreter multiplies bfloat16 operands
of `tl.dot` as their raw uint16 storage (triton 3.9, triton-lang/triton#11584), so under it the kernels
upcast dot operands to float32, which gives the same exact products the GPU's bf16 dot makes.
"""

from __future__ import annotations

import torch
import triton.language as tl
from triton import knobs

TRITON_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def interpreting() -> bool:
    """Kernels run in Triton's CPU interpreter: dot operands must be upcast to float32."""
    return bool(knobs.runtime.interpret)


def dot_options(dtype: torch.dtype) -> dict[str, object]:
    """Constexprs DOT_DTYPE and PRECISION for operands of `dtype`: their own type on a GPU, float32
    (exact) for float32 and under the interpreter."""
    if dtype == torch.float32 or interpreting():
        return {"DOT_DTYPE": tl.float32, "PRECISION": "ieee"}
    return {"DOT_DTYPE": TRITON_DTYPES[dtype], "PRECISION": dot_precision(dtype)}
