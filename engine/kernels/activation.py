"""SiLU(gate) * up from the fused gate_up projection, in Triton.

Same semantics as `reference.silu_mul`: the MLP's gate and up halves are read once from the one
[T, 2 I] matmul output and the product written once, instead of a SiLU kernel and a multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .row_tiles import rows_per_program

BLOCK = 1024  # columns per program: SmolLM2's 1536 in two, Llama-2-7B's 11008 in 11


@triton.jit(do_not_specialize=["num_rows"])
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    num_rows,
    stride_in,
    stride_out,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < INTERMEDIATE)[None, :]
    src = gate_up_ptr + rows[:, None] * stride_in + cols[None, :]
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + INTERMEDIATE, mask=mask, other=0.0)
    # Each op rounds to the model dtype, as torch's F.silu(gate) * up does.
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(
        out_ptr + rows[:, None] * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask
    )


def silu_mul(gate_up: torch.Tensor, rows_each: int | None = None) -> torch.Tensor:
    """SwiGLU's activation.

    Shapes: gate_up [T, 2 I] (gate columns first, contiguous last axis). Returns [T, I].
    Semantics: out[t] = silu(gate_up[t, :I]) * gate_up[t, I:],  silu(g) = g / (1 + exp(-g)).
    `rows_each`: rows per program, a power of two (default: row_tiles.rows_per_program).
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(
            f"silu_mul takes [T, 2 * intermediate] with a contiguous last axis, got {tuple(gate_up.shape)}"
        )
    num_rows, width = gate_up.shape
    intermediate = width // 2
    out = torch.empty(num_rows, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0:
        return out
    rows_each = rows_each or rows_per_program(gate_up.device, num_rows, BLOCK)
    _silu_mul_kernel[(triton.cdiv(num_rows, rows_each), triton.cdiv(intermediate, BLOCK))](
        gate_up,
        out,
        num_rows,
        gate_up.stride(0),
        out.stride(0),
        INTERMEDIATE=intermediate,
        BLOCK=BLOCK,
        ROWS=rows_each,
        num_warps=4,
    )
    return out
