"""The @triton.jit pieces the LoRA kernels' token (BGMV-style) and segment (SGMV-style) forms share.

Each form differs only in how many tokens a program takes (one, or BLOCK_M of one segment) and so in
its products (a matrix-vector product or tl.dot); which rows an adapter owns, where they are in the
pool, how a K split divides the input and how results land are the same, and live here once. Triton
inlines these into the kernels, so they cost nothing at run time.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rank_of_slot(slot, slot_rank_ptr):
    """The rank of `slot` in this group (0 for slot -1, no adapter)."""
    return tl.where(slot < 0, 0, tl.load(slot_rank_ptr + tl.maximum(slot, 0)))


@triton.jit
def a_row_offsets(a_starts_ptr, slot_start_ptr, slot, rows, row_ok, HEAD_DIM: tl.constexpr):
    """Flat pool offsets of the slot's A rows `rows` [BLOCK_R] (0 where masked: the zero page)."""
    a_row = tl.load(a_starts_ptr + tl.load(slot_start_ptr + slot) + rows, mask=row_ok, other=0)
    return a_row.to(tl.int64) * HEAD_DIM


@triton.jit
def k_range(in_width, split, SPLIT_K, BLOCK_K: tl.constexpr):
    """[k_begin, k_end) of `in` that split `split` of SPLIT_K sums. Splits cover whole BLOCK_K steps,
    so every split's blocks line up with the unsplit loop's."""
    k_per_split = tl.cdiv(tl.cdiv(in_width, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, in_width)
    return k_begin, k_end


@triton.jit
def write_shrunk(out, total, mask, SPLIT_K):
    """Store a shrink tile; with several splits, add it to the others' (out starts as zeros)."""
    if SPLIT_K == 1:
        tl.store(out, total, mask=mask)
    else:
        tl.atomic_add(out, total, mask=mask)


@triton.jit
def b_tile(
    pool_ptr,
    b_starts_ptr,
    b_cols_ptr,
    b_widths_ptr,
    first_row,
    rows,
    row_ok,
    cols,
    col_ok,
    HEAD_DIM: tl.constexpr,
    COL_ALIGN: tl.constexpr,
):
    """[BLOCK_R, BLOCK_N] of the scaled B^T rows `rows` of an adapter whose rows start at stacked row
    `first_row`, at output columns `cols`: zero outside each row's module and past the rank."""
    b_row = tl.load(b_starts_ptr + first_row + rows, mask=row_ok, other=0)
    # Known alignment lets a B row's tile load as 128-bit vectors instead of 16-bit scalars.
    b_col = tl.multiple_of(tl.load(b_cols_ptr + first_row + rows, mask=row_ok, other=0), COL_ALIGN)
    b_width = tl.multiple_of(tl.load(b_widths_ptr + first_row + rows, mask=row_ok, other=0), COL_ALIGN)
    offset = cols[None, :] - b_col[:, None]  # [BLOCK_R, BLOCK_N]: column inside the row's module
    inside = (offset >= 0) & (offset < b_width[:, None]) & col_ok[None, :]
    return tl.load(pool_ptr + b_row.to(tl.int64)[:, None] * HEAD_DIM + offset, mask=inside, other=0.0)


@triton.jit
def add_into(y, delta, mask):
    """y += delta in place, summed in float32 and rounded once to y's dtype."""
    old = tl.load(y, mask=mask, other=0.0)
    tl.store(y, (old.to(tl.float32) + delta).to(old.dtype), mask=mask)
