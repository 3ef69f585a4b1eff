"""RMSNorm, alone or fused with the residual add before it, in Triton.

Same semantics as `reference.rms_norm` / `reference.add_rms_norm` (Hugging Face's LlamaRMSNorm):
normalise in float32, cast to the input dtype, then multiply by the weight. One row per program on a
GPU (row_tiles.py); a decode layer's two residual adds ride in its two norms, so the sum is written once
and no separate kernel reads it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .row_tiles import rows_per_program


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr,
    delta_ptr,
    sum_ptr,
    weight_ptr,
    out_ptr,
    num_rows,
    stride_x,
    stride_delta,
    stride_sum,
    stride_out,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    ADD: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if ADD:
        # Rounded to the model dtype before the norm reads it, as torch's `hidden + out` is.
        delta = tl.load(delta_ptr + rows[:, None] * stride_delta + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + rows[:, None] * stride_sum + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=1) / N + eps)  # [ROWS]
    normed = (xf * inv_rms[:, None]).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=cols < N, other=0.0)
    out = weight.to(tl.float32)[None, :] * normed.to(tl.float32)
    tl.store(
        out_ptr + rows[:, None] * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask
    )


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"rms_norm takes rows [T, hidden] with a contiguous last axis, got {tuple(x.shape)}")
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
        raise ValueError(
            f"rms_norm weight must be [{x.shape[1]}] of {x.dtype}, got {tuple(weight.shape)} {weight.dtype}"
        )


def _launch(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    total: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    rows_each: int | None,
) -> torch.Tensor:
    num_rows, hidden = x.shape
    out = torch.empty_like(x)
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(hidden)
    rows_each = rows_each or rows_per_program(x.device, num_rows, hidden)
    _rms_norm_kernel[(triton.cdiv(num_rows, rows_each),)](
        x,
        delta if delta is not None else x,
        total if total is not None else out,
        weight,
        out,
        num_rows,
        x.stride(0),
        delta.stride(0) if delta is not None else 0,
        total.stride(0) if total is not None else 0,
        out.stride(0),
        eps,
        N=hidden,
        BLOCK=block,
        ROWS=rows_each,
        ADD=delta is not None,
        num_warps=min(max(block // 512, 1), 8),  # ~16 elements a thread: no spills at 8k wide
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, rows_each: int | None = None) -> torch.Tensor:
    """RMSNorm of each row.

    Shapes: x [T, hidden] (rows may be strided), weight [hidden], same dtype. Returns [T, hidden].
    Semantics: out[t] = weight * (x[t] / sqrt(mean(x[t]^2) + eps))  (float32 math, cast before weight).
    `rows_each`: rows per program, a power of two (default: row_tiles.rows_per_program).
    """
    _check(x, weight)
    return _launch(x, None, None, weight, eps, rows_each)


def add_rms_norm(
    hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, rows_each: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm in one pass: returns (hidden + delta, rmsnorm of it).

    Shapes: hidden, delta [T, hidden] of one dtype, weight [hidden]. Returns two new [T, hidden].
    Semantics: s = hidden + delta (rounded to the dtype); out = rms_norm(s, weight, eps).
    """
    _check(hidden, weight)
    if delta.shape != hidden.shape or delta.dtype != hidden.dtype or delta.stride(1) != 1:
        raise ValueError(
            f"add_rms_norm: delta {tuple(delta.shape)} {delta.dtype} must match hidden "
            f"{tuple(hidden.shape)} {hidden.dtype} with a contiguous last axis"
        )
    total = torch.empty_like(hidden)
    return total, _launch(hidden, delta, total, weight, eps, rows_each)
