"""Paged prefill attention in Triton: chunks of new tokens attending causally to their cached prefix and
to themselves.

`prefill_attention` has the signature and semantics of `reference.prefill_attention` (one sequence);
`prefill_attention_varlen` serves several sequences' chunks, packed back to back in q, in one launch.
The chunks' own keys and values must already be in the pool. One program per (tile of BLOCK_M query
rows of one chunk, query head) walks the sequence's keys BLOCK_N at a time up to the tile's causal
limit, looking each key's page up in the block table, with an online softmax in float32 (flash
attention's forward pass over a paged cache; online_softmax.py, shared with decode).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dot import dot_options
from .gpu import gpu_target
from .online_softmax import online_softmax_step
from .paged_decode_attention import LOG2_E

# 64 x 64 tiles: the usual flash-attention forward tile for head_dim 64-128 on an H100 with 4 warps.
BLOCK_M = 64
BLOCK_N = 64


def tile(dtype: torch.dtype, head_dim: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) that compile without register spills (ptxas -v through
    engine/aot.py): at head_dim 128 on sm_80, 4 warps hold the 64 x 64 tile in 255 registers
    and spill, and 8 warps take 172; float32's exact ("ieee") dots need 16 x 32 tiles in one stage."""
    if dtype == torch.float32:
        return 16, 32, 4, 1
    target = gpu_target(device)
    if target is not None and target.arch < 90 and head_dim > 64:
        return BLOCK_M, BLOCK_N, 8, 2
    return BLOCK_M, BLOCK_N, 4, 2


# The layer and the block tables' width change between launches: specializing on their values would
# compile a variant per class of value (== 1, divisible by 16), each on first use. The metadata are
# views at any offset of the step's one upload (engine/batch.py), so their alignment varies too.
@triton.jit(
    do_not_specialize=["layer", "stride_bt"],
    do_not_specialize_on_alignment=["block_tables_ptr", "q_starts_ptr", "context_lens_ptr"],
)
def _prefill_kernel(
    q_ptr,
    memory_ptr,
    block_tables_ptr,
    q_starts_ptr,
    context_lens_ptr,
    out_ptr,
    layer,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_page,
    stride_layer,
    stride_part,
    stride_head,
    stride_off,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(q_starts_ptr + seq)
    chunk_len = tl.load(q_starts_ptr + seq + 1) - q_start
    # The grid is sized for the longest chunk; shorter chunks' surplus tiles stop here.
    if tile * BLOCK_M >= chunk_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    prefix_len = context_len - chunk_len

    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_mask = (d < HEAD_DIM)[None, :]
    row_mask = (i < chunk_len)[:, None] & d_mask
    q_rows = (q_start + i).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=row_mask, other=0.0)
    q = q.to(DOT_DTYPE)
    positions = prefix_len + i  # of the query rows in the sequence; padded rows lie past its end

    keys_ptr = memory_ptr + layer * stride_layer + (head // GROUP) * stride_head
    values_ptr = keys_ptr + stride_part
    table_ptr = block_tables_ptr + seq * stride_bt

    # Scores in log2 units (scaled by log2(e)) so the softmax can use exp2.
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    key_end = tl.minimum(prefix_len + (tile + 1) * BLOCK_M, context_len)
    for key_tile in range(0, key_end, BLOCK_N):
        keys = key_tile + n
        valid = keys < key_end
        pages = tl.load(table_ptr + keys // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        rows = pages * stride_page + (keys % PAGE_SIZE) * stride_off  # [BLOCK_N]
        kv_mask = valid[:, None] & d_mask
        k = tl.load(keys_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        # Key 0 is visible to every row (padded ones too), so m is finite after the first tile.
        visible = valid[None, :] & (keys[None, :] <= positions[:, None])
        s = tl.where(visible, s, float("-inf"))
        v_ptrs = values_ptr + rows[:, None] + d[None, :]
        m, row_sum, acc = online_softmax_step(s, v_ptrs, kv_mask, m, row_sum, acc, DOT_DTYPE, PRECISION)

    out = acc / row_sum[:, None]
    out_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask)


def prefill_attention_varlen(
    q: torch.Tensor,
    memory: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_chunk_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of several sequences' chunks of new tokens, packed in q, in one launch.

    Shapes: q [T, heads, head_dim]; memory [num_pages, layers, 2, kv_heads, page_size, head_dim]
    (contiguous); block_tables [S, max_blocks] int64; q_starts [S + 1] (q_starts[0] = 0,
    q_starts[S] = T); context_lens [S]. Returns [T, heads, head_dim] in q.dtype.
    Semantics: rows q_starts[s]..q_starts[s+1]-1 are the last tokens of sequence s's context_lens[s]
    tokens, each attending to the sequence's keys up to and including its own position.
    max_chunk_len: the longest chunk if the caller knows it (sizes the grid); None uses T, which costs
    only idle programs and needs no device sync.
    """
    total, heads, dim = q.shape
    num_seqs = context_lens.shape[0]
    _, _, _, kv_heads, page_size, _ = memory.shape
    assert memory.is_contiguous(), "the pool must be contiguous"
    assert q.stride(2) == 1, "head_dim must be the contiguous axis of q"
    assert heads % kv_heads == 0, "query heads must be a multiple of kv heads"
    out = torch.empty(total, heads, dim, dtype=q.dtype, device=q.device)
    if total == 0 or num_seqs == 0:
        return out
    longest = total if max_chunk_len is None else max_chunk_len
    block_m, block_n, warps, stages = tile(memory.dtype, dim, q.device)
    _prefill_kernel[(triton.cdiv(longest, block_m), num_seqs, heads)](
        q,
        memory,
        block_tables,
        q_starts,
        context_lens,
        out,
        layer,
        scale * LOG2_E,
        q.stride(0),
        q.stride(1),
        *memory.stride()[:5],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=heads // kv_heads,
        HEAD_DIM=dim,
        BLOCK_D=triton.next_power_of_2(dim),
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        **dot_options(memory.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    return out


def prefill_attention(
    q: torch.Tensor,
    memory: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's chunk of new tokens to its cached prefix and to itself.

    Shapes: q [T, heads, head_dim]; block_table [num_blocks] int64. Returns [T, heads, head_dim].
    Semantics: out[i] = softmax(q[i] · K[:p_i+1]^T * scale) V[:p_i+1], p_i = context_len - T + i.
    """
    num_new = q.shape[0]
    q_starts = torch.tensor([0, num_new], dtype=torch.int64, device=q.device)
    context_lens = torch.tensor([context_len], dtype=torch.int64, device=q.device)
    return prefill_attention_varlen(
        q, memory, layer, block_table[None], q_starts, context_lens, scale, max_chunk_len=num_new
    )
