"""LoRA expand over many adapters at once: add every token's shrunk activations times its own adapter's
scaled B^T rows to the projection's output, in place (Triton).

Stacked row c's B^T row starts at pool row b_starts[c] and covers output columns b_cols[c] ..
b_cols[c] + b_widths[c] - 1: a group's modules (q | k | v, gate | up) each own a column block, so a
program computing an output tile masks out the rows of the other modules, and padding rows (width 0)
contribute nothing. Slot u owns rows slot_start[u] .. slot_start[u] + slot_rank[u] - 1, and a program
walks its adapter's rank in BLOCK_R steps, whatever it is.

- segments (prefill, SGMV-style): a program takes BLOCK_M tokens of one segment and BLOCK_N columns,
  loading each B tile once for all of them (tl.dot);
- tokens (decode, BGMV-style): a program takes one token and BLOCK_N columns.

Rows of tokens without an adapter (or whose adapter has rank 0 in this group) are not read or written.
The tables and token maps come in one `LoRAKernelMeta` (lora_meta.py); the pieces both forms share are
in lora_tiles.py. Semantics, shapes and the plain-torch oracle: `reference.lora_expand_tokens` /
`lora_expand_segments`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .dot import dot_precision, interpreting
from .lora_meta import LoRAKernelMeta
from .lora_tiles import add_into, b_tile

# m_blocks and stride_sm (the step's widest rank) change from step to step: specializing on their values
# (== 1, divisible by 16) would compile a variant per value met. The step's metadata are views at any
# offset of one upload (engine/batch.py), so their alignment varies as well.
_STEP_METADATA = ["token_slot_ptr", "seg_starts_ptr", "seg_slot_ptr"]


@triton.jit(do_not_specialize=["stride_sm", "m_blocks"], do_not_specialize_on_alignment=_STEP_METADATA)
def _expand_segments_kernel(
    y_ptr,
    shrunk_ptr,
    pool_ptr,
    b_starts_ptr,
    b_cols_ptr,
    b_widths_ptr,
    slot_start_ptr,
    slot_rank_ptr,
    seg_starts_ptr,
    seg_slot_ptr,
    out_width,
    stride_ym,
    stride_yn,
    stride_sm,
    m_blocks,  # token blocks per segment in the grid (the longest segment's)
    HEAD_DIM: tl.constexpr,
    COL_ALIGN: tl.constexpr,  # b_cols and b_widths are multiples of it (see _col_align)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
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
    rank = tl.load(slot_rank_ptr + slot)
    if rank == 0:  # an adapter that does not adapt this group: y stays as it is, bit for bit
        return
    first_row = tl.load(slot_start_ptr + slot)
    tokens = first + tl.arange(0, BLOCK_M)
    token_ok = tokens < seg_end
    tokens64 = tokens.to(tl.int64)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < out_width

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < rank
        s = tl.load(
            shrunk_ptr + tokens64[:, None] * stride_sm + rows[None, :],
            mask=token_ok[:, None] & row_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_R]
        b = b_tile(
            pool_ptr,
            b_starts_ptr,
            b_cols_ptr,
            b_widths_ptr,
            first_row,
            rows,
            row_ok,
            cols,
            col_ok,
            HEAD_DIM,
            COL_ALIGN,
        )  # [BLOCK_R, BLOCK_N]
        # The shrunk values enter the dot in the weights' dtype (bf16 tensor cores), summed in float32.
        if UPCAST:
            acc += tl.dot(s.to(b.dtype).to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
        else:
            acc += tl.dot(s.to(b.dtype), b, input_precision=PRECISION)

    y = y_ptr + tokens64[:, None] * stride_ym + cols[None, :] * stride_yn
    add_into(y, acc, token_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["stride_sm"], do_not_specialize_on_alignment=_STEP_METADATA)
def _expand_tokens_kernel(
    y_ptr,
    shrunk_ptr,
    pool_ptr,
    b_starts_ptr,
    b_cols_ptr,
    b_widths_ptr,
    slot_start_ptr,
    slot_rank_ptr,
    token_slot_ptr,
    out_width,
    stride_ym,
    stride_yn,
    stride_sm,
    HEAD_DIM: tl.constexpr,
    COL_ALIGN: tl.constexpr,  # b_cols and b_widths are multiples of it (see _col_align)
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    token = tl.program_id(0)
    n_block = tl.program_id(1)
    slot = tl.load(token_slot_ptr + token)
    if slot < 0:
        return
    rank = tl.load(slot_rank_ptr + slot)
    if rank == 0:  # an adapter that does not adapt this group: y stays as it is, bit for bit
        return
    first_row = tl.load(slot_start_ptr + slot)
    token64 = token.to(tl.int64)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < out_width

    # Products are summed over the rank once at the end rather than reduced every step.
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < rank
        s = tl.load(shrunk_ptr + token64 * stride_sm + rows, mask=row_ok, other=0.0)
        b = b_tile(
            pool_ptr,
            b_starts_ptr,
            b_cols_ptr,
            b_widths_ptr,
            first_row,
            rows,
            row_ok,
            cols,
            col_ok,
            HEAD_DIM,
            COL_ALIGN,
        )  # [BLOCK_R, BLOCK_N]
        acc += s.to(tl.float32)[:, None] * b.to(tl.float32)
    add_into(y_ptr + token64 * stride_ym + cols * stride_yn, tl.sum(acc, axis=0), col_ok)


def _col_align(head_dim: int) -> int:
    """What every b_col and b_width is a multiple of: a module's B^T row spans whole pool rows of
    head_dim elements (engine/lora/tables.py), and 16 elements make the widest load worth knowing."""
    return math.gcd(head_dim, 16)


def _check(y: torch.Tensor, shrunk: torch.Tensor, pool_rows: torch.Tensor) -> None:
    if not pool_rows.is_contiguous():
        raise ValueError("pool_rows must be contiguous: rows are addressed as flat offsets")
    if shrunk.stride(1) != 1 or y.dim() != 2 or shrunk.shape[0] != y.shape[0]:
        raise ValueError(f"y {tuple(y.shape)} and shrunk {tuple(shrunk.shape)} do not fit together")


def lora_expand_segments(
    y: torch.Tensor, shrunk: torch.Tensor, pool_rows: torch.Tensor, meta: LoRAKernelMeta, layer: int
) -> None:
    """Expand, in place, for the rows of y grouped in meta's segments, with layer `layer`'s B rows.

    Shapes: y [T, out]; shrunk [T, R] (float32 from lora_shrink_*); pool_rows [N, head_dim] contiguous;
    meta as in lora_meta.py, with seg_starts and seg_slot.
    """
    _check(y, shrunk, pool_rows)
    seg_starts, seg_slot, max_seg_len = meta.segments()
    num_tokens, out_width = y.shape
    num_segments = len(seg_slot)
    if shrunk.shape[1] == 0 or num_segments == 0 or max_seg_len == 0 or num_tokens == 0:
        return
    block_m = 16 if max_seg_len <= 16 else 32 if max_seg_len <= 32 else 64
    # float32's exact dots spill a [64, 32] x [32, 64] step on sm_80 (ptxas -v, engine/aot.py).
    block_r = 16 if shrunk.shape[1] <= 16 or y.dtype == torch.float32 else 32
    block_n = 128 if y.element_size() <= 2 else 64
    m_blocks = triton.cdiv(max_seg_len, block_m)
    _expand_segments_kernel[(num_segments * m_blocks, triton.cdiv(out_width, block_n))](
        y,
        shrunk,
        pool_rows,
        meta.b_starts[layer],
        meta.b_cols[layer],
        meta.b_widths[layer],
        meta.slot_start,
        meta.slot_rank,
        seg_starts,
        seg_slot,
        out_width,
        y.stride(0),
        y.stride(1),
        shrunk.stride(0),
        m_blocks,
        HEAD_DIM=pool_rows.shape[1],
        COL_ALIGN=meta.col_align or _col_align(pool_rows.shape[1]),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        PRECISION=dot_precision(pool_rows.dtype),
        UPCAST=interpreting(),
    )


def lora_expand_tokens(
    y: torch.Tensor, shrunk: torch.Tensor, pool_rows: torch.Tensor, meta: LoRAKernelMeta, layer: int
) -> None:
    """Expand, in place, with every row of y's adapter slot given per token (meta.token_slot), with
    layer `layer`'s B rows.

    Shapes: y [T, out]; shrunk [T, R] (float32 from lora_shrink_*); pool_rows [N, head_dim] contiguous;
    meta as in lora_meta.py, token_slot [T].
    """
    _check(y, shrunk, pool_rows)
    token_slot = meta.tokens()
    num_tokens, out_width = y.shape
    if shrunk.shape[1] == 0 or num_tokens == 0:
        return
    # A [BLOCK_R, BLOCK_N] tile of about 4096 elements; ranks past BLOCK_R take more steps.
    block_r = min(max(triton.next_power_of_2(shrunk.shape[1]), 8), 32)
    block_n = min(4096 // block_r, 256)
    _expand_tokens_kernel[(num_tokens, triton.cdiv(out_width, block_n))](
        y,
        shrunk,
        pool_rows,
        meta.b_starts[layer],
        meta.b_cols[layer],
        meta.b_widths[layer],
        meta.slot_start,
        meta.slot_rank,
        token_slot,
        out_width,
        y.stride(0),
        y.stride(1),
        shrunk.stride(0),
        HEAD_DIM=pool_rows.shape[1],
        COL_ALIGN=meta.col_align or _col_align(pool_rows.shape[1]),
        BLOCK_N=block_n,
        BLOCK_R=block_r,
    )
