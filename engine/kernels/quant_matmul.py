"""Weight-only quantized GEMMs in Triton: W8A16 (per-channel int8) and W4A16 (group-wise int4).

`y = x @ dequantize(w, x.dtype).T` for a `QuantizedWeight` (engine/model/quant.py has the format):
x [M, K] in float16, bfloat16 or float32, y [M, N] in x's dtype. The weight tile is read as codes and
widened in registers, so a decode step reads 1 (int8) or 1/2 + group metadata (int4) bytes per weight
instead of 2: decode at small M is bound by those bytes.

Dequantization follows the reference exactly: each code times its scale (plus the int4 offset) in
float32, rounded to x's dtype, then a `tl.dot` accumulating in float32 (operands as dot.py says: exact
products for float32, float32 operands under the CPU interpreter). int8's per-channel scale is
factored out of the K sum (applied once to the accumulator), which is exact in real arithmetic and
differs from the reference only by rounding.

Tiles are chosen by M (`_blocks`): at M <= 16 the GEMM is a GEMV in disguise, so one 16-row tile and
wide N/K tiles stream the weight; at larger M taller tiles reuse each weight tile across more rows.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

from .dot import dot_options


class QuantizedWeight(Protocol):
    """What the kernels read of engine/model/quant.py's QuantizedWeight (kernels/ imports only torch and
    triton, so the format is named here by its fields)."""

    @property
    def kind(self) -> str: ...
    @property
    def qweight(self) -> torch.Tensor: ...
    @property
    def scales(self) -> torch.Tensor: ...
    @property
    def zeros(self) -> torch.Tensor | None: ...
    @property
    def group_size(self) -> int: ...
    @property
    def out_features(self) -> int: ...
    @property
    def in_features(self) -> int: ...
    @property
    def device(self) -> torch.device: ...


_ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit(do_not_specialize=["M"])
def _w8a16_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_x,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        q = tl.load(
            q_ptr + cols[:, None].to(tl.int64) * K + ks[None, :],
            mask=col_mask[:, None] & k_mask[None, :],
            other=0,
        )
        # int8 codes are exact in every activation dtype: the scale waits for the accumulator.
        w = q.to(DOT_DTYPE)
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w), input_precision=PRECISION)
    scale = tl.load(scale_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    out = acc * scale[None, :]
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    zero_ptr,
    out_ptr,
    M,
    N,
    K,
    G: tl.constexpr,
    stride_x,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    groups = K // G
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        w_mask = col_mask[:, None] & k_mask[None, :]
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        # Both codes of a byte are read by neighbouring k (the second load of a byte hits in cache):
        # even k takes the low nibble, odd k the high one, as pack_int4 stores them.
        packed = tl.load(
            q_ptr + cols[:, None].to(tl.int64) * (K // 2) + (ks // 2)[None, :], mask=w_mask, other=0
        )
        q = (packed >> ((ks & 1) * 4).to(tl.uint8)[None, :]) & 0xF
        meta = cols[:, None].to(tl.int64) * groups + (ks // G)[None, :]
        scale = tl.load(scale_ptr + meta, mask=w_mask, other=0.0).to(tl.float32)
        zero = tl.load(zero_ptr + meta, mask=w_mask, other=0.0).to(tl.float32)
        # As the reference: code * scale + offset in float32, rounded to the activation dtype.
        w = (q.to(tl.float32) * scale + zero).to(x_ptr.dtype.element_ty).to(DOT_DTYPE)
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w), input_precision=PRECISION)
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def _blocks(m: int, kind: str = "int8") -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for M rows.

    Decode (M <= 16): tl.dot's smallest tile is 16 rows, so one row tile holds the whole batch and the
    program streams a 64 x 128 weight tile per step (wide K, deep pipeline: the loads are the cost).
    Up to 64 rows one taller tile still reads each weight once; past that 64 x 128 output tiles
    reuse each weight tile across 64 rows, the prefill shape.
    """
    if kind == "int4":
        # int4 widens each code with its own scale and offset in registers: weight tiles past 64 x 64
        # spill on sm_80/sm_90 (the AOT gate's figures), so both keep 64 x 64, and the 16-row tile
        # spills at 4 warps but not at 8.
        return (16, 64, 64, 8, 3) if m <= 16 else (64, 64, 64, 4, 3)
    if m <= 16:
        return 16, 64, 128, 4, 4
    if m <= 64:
        return 64, 64, 64, 4, 3
    return 64, 128, 64, 4, 3


def _check(x: torch.Tensor, w: QuantizedWeight, kind: str) -> None:
    if w.kind != kind:
        raise ValueError(
            f"{'w8a16' if kind == 'int8' else 'w4a16'}_matmul takes an {kind} weight, got {w.kind}"
        )
    if x.dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"activations must be float16, bfloat16 or float32, got {x.dtype}")
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {w.in_features}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device}, the weight on {w.device}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def w8a16_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [..., K] @ dequantize(w).T for a per-channel int8 weight -> [..., N] in x's dtype."""
    _check(x, w, "int8")
    x2 = _rows(x)
    m, n, k = x2.shape[0], w.out_features, w.in_features
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        bm, bn, bk, warps, stages = _blocks(m)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _w8a16_kernel[grid](
            x2, w.qweight.contiguous(), w.scales.contiguous(), out, m, n, k, x2.stride(0), out.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **dot_options(x.dtype),
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)


def w4a16_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [..., K] @ dequantize(w).T for a group-wise int4 weight -> [..., N] in x's dtype."""
    _check(x, w, "int4")
    assert w.zeros is not None  # QuantizedWeight refuses int4 without zeros
    x2 = _rows(x)
    m, n, k = x2.shape[0], w.out_features, w.in_features
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        bm, bn, bk, warps, stages = _blocks(m, "int4")
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _w4a16_kernel[grid](
            x2, w.qweight.contiguous(), w.scales.contiguous(), w.zeros.contiguous(), out,
            m, n, k, w.group_size, x2.stride(0), out.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **dot_options(x.dtype),
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)
