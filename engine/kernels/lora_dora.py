"""DoRA's per-channel scale over many adapters at once: after the expand kernel has added every row's
LoRA delta, multiply the rows of DoRA adapters by 1 + h, h = g - 1 their adapter's scale for this layer
and projection group (engine/lora/dora.py), in place (Triton).

Slot u's g - 1 row for layer l is a run of pool rows starting at d_starts[l, slot_start[u]] (0: the
adapter has no scale there, a plain LoRA adapter or a layer a DoRA adapter skips), covering the group's
whole output width (0 in the columns of modules it does not adapt). Rows without an adapter, of a plain
LoRA adapter or of an adapter with rank 0 in this group are not read or written.

Why a kernel of its own rather than the expand kernel's epilogue: the scale is launched only in steps
that hold a DoRA adapter (the stacker knows that on the host), so the expand kernels, their tuned tiles
and their register budget (the AOT gate) stay exactly what they were for plain LoRA; it costs one more
read and write of the DoRA rows' outputs, T x out elements against the base matmul's T x in x out.

- segments (prefill): a program takes BLOCK_M tokens of one segment and BLOCK_N columns;
- tokens (decode): a program takes one token and BLOCK_N columns.

Semantics and the plain-torch oracle: `reference.lora_dora_scale_tokens` / `lora_dora_scale_segments`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .lora_meta import LoRAKernelMeta

_STEP_METADATA = ["token_slot_ptr", "seg_starts_ptr", "seg_slot_ptr"]


@triton.jit
def _scale_row_start(slot, slot_start_ptr, slot_rank_ptr, d_starts_ptr):
    """The pool row where `slot`'s g - 1 row begins (0: nothing to scale)."""
    rank = tl.load(slot_rank_ptr + slot)
    d_row = tl.load(d_starts_ptr + tl.load(slot_start_ptr + slot))
    return tl.where(rank == 0, 0, d_row)


@triton.jit
def _scale_into(y, h, mask):
    """y *= 1 + h in place, in float32, rounded once to y's dtype."""
    old = tl.load(y, mask=mask, other=0.0)
    tl.store(y, (old.to(tl.float32) * (1.0 + h)).to(old.dtype), mask=mask)


@triton.jit(do_not_specialize=["m_blocks"], do_not_specialize_on_alignment=_STEP_METADATA)
def _dora_segments_kernel(
    y_ptr,
    pool_ptr,
    d_starts_ptr,
    slot_start_ptr,
    slot_rank_ptr,
    seg_starts_ptr,
    seg_slot_ptr,
    out_width,
    stride_ym,
    stride_yn,
    m_blocks,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    segment = tl.program_id(0) // m_blocks
    m_block = tl.program_id(0) % m_blocks
    n_block = tl.program_id(1)
    slot = tl.load(seg_slot_ptr + segment)
    if slot < 0:
        return
    seg_end = tl.load(seg_starts_ptr + segment + 1)
    first = tl.load(seg_starts_ptr + segment) + m_block * BLOCK_M
    if first >= seg_end:
        return
    d_row = _scale_row_start(slot, slot_start_ptr, slot_rank_ptr, d_starts_ptr)
    if d_row == 0:
        return
    tokens = first + tl.arange(0, BLOCK_M)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < out_width
    h = tl.load(pool_ptr + d_row.to(tl.int64) * HEAD_DIM + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = y_ptr + tokens.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn
    _scale_into(y, h[None, :], (tokens < seg_end)[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize_on_alignment=_STEP_METADATA)
def _dora_tokens_kernel(
    y_ptr,
    pool_ptr,
    d_starts_ptr,
    slot_start_ptr,
    slot_rank_ptr,
    token_slot_ptr,
    out_width,
    stride_ym,
    stride_yn,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    token = tl.program_id(0)
    n_block = tl.program_id(1)
    slot = tl.load(token_slot_ptr + token)
    if slot < 0:
        return
    d_row = _scale_row_start(slot, slot_start_ptr, slot_rank_ptr, d_starts_ptr)
    if d_row == 0:
        return
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < out_width
    h = tl.load(pool_ptr + d_row.to(tl.int64) * HEAD_DIM + cols, mask=col_ok, other=0.0).to(tl.float32)
    _scale_into(y_ptr + token.to(tl.int64) * stride_ym + cols * stride_yn, h, col_ok)


def _d_starts(meta: LoRAKernelMeta, layer: int) -> torch.Tensor:
    if meta.d_starts is None:
        raise ValueError("the DoRA scale needs meta.d_starts (the step holds no DoRA adapter)")
    return meta.d_starts[layer]


def lora_dora_scale_segments(
    y: torch.Tensor, pool_rows: torch.Tensor, meta: LoRAKernelMeta, layer: int
) -> None:
    """Scale, in place, the rows of y grouped in meta's segments whose adapter is a DoRA one, by its
    layer `layer` 1 + h. Shapes: y [T, out]; pool_rows [N, head_dim] contiguous; meta with seg_starts,
    seg_slot and d_starts."""
    if not pool_rows.is_contiguous():
        raise ValueError("pool_rows must be contiguous: rows are addressed as flat offsets")
    d_starts = _d_starts(meta, layer)
    seg_starts, seg_slot, max_seg_len = meta.segments()
    num_tokens, out_width = y.shape
    if len(seg_slot) == 0 or max_seg_len == 0 or num_tokens == 0:
        return
    block_m = 16 if max_seg_len <= 16 else 32
    block_n = 128
    m_blocks = triton.cdiv(max_seg_len, block_m)
    _dora_segments_kernel[(len(seg_slot) * m_blocks, triton.cdiv(out_width, block_n))](
        y,
        pool_rows,
        d_starts,
        meta.slot_start,
        meta.slot_rank,
        seg_starts,
        seg_slot,
        out_width,
        y.stride(0),
        y.stride(1),
        m_blocks,
        HEAD_DIM=pool_rows.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )


def lora_dora_scale_tokens(
    y: torch.Tensor, pool_rows: torch.Tensor, meta: LoRAKernelMeta, layer: int
) -> None:
    """lora_dora_scale_segments with every row's slot given per token (meta.token_slot [T])."""
    if not pool_rows.is_contiguous():
        raise ValueError("pool_rows must be contiguous: rows are addressed as flat offsets")
    d_starts = _d_starts(meta, layer)
    token_slot = meta.tokens()
    num_tokens, out_width = y.shape
    if num_tokens == 0:
        return
    block_n = 256
    _dora_tokens_kernel[(num_tokens, triton.cdiv(out_width, block_n))](
        y,
        pool_rows,
        d_starts,
        meta.slot_start,
        meta.slot_rank,
        token_slot,
        out_width,
        y.stride(0),
        y.stride(1),
        HEAD_DIM=pool_rows.shape[1],
        BLOCK_N=block_n,
    )
