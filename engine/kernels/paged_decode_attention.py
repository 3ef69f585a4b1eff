"""Paged decode attention in Triton: one new query token per sequence against its paged KV cache.

Same signature and semantics as `reference.paged_decode_attention`. Flash-decoding layout: one program
per (sequence, kv head) serves that kv head's G query heads together, so each cached key and value is
read from memory once per group rather than once per query head; the G rows are padded to a tile of
at least 16 (the smallest `tl.dot` operand) and masked. The program walks the sequence's tokens
BLOCK_N at a time, looking each token's page up in the block table (so any page size works and
BLOCK_N need not match it), with an online softmax in float32 (online_softmax.py, shared with prefill).

When there are too few (sequence, kv head) pairs to fill the GPU, long contexts are split into
partitions handled by separate programs (split-K); each writes its partial output and log-sum-exp in
float32 and a second kernel merges the partitions of every (sequence, head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dot import dot_options
from .gpu import gpu_target
from .online_softmax import online_softmax_step

# Keys per loop step: large enough to keep the tensor cores and the memory pipeline busy, small enough
# that a short context wastes little of its last tile.
BLOCK_N = 64
# Split-K only pays once each partition still streams a good stretch of cache...
MIN_PARTITION_TOKENS = 256
# ...unless the grid would leave most SMs idle (batch 1: 8 programs on 132 SMs for Llama-3-8B), where
# even two tiles per partition beat one program walking the whole context.
MIN_PARTITION_TOKENS_STARVED = 2 * BLOCK_N
# Decode is bound by memory bandwidth; an SM needs a few resident programs' loads in flight to reach it.
PROGRAMS_PER_SM = 4
LOG2_E = 1.4426950408889634


# The layer, the partition size and count (stride_pb, stride_ph of the partial results) and the block
# tables' width change between launches; specializing on their values (== 1, divisible by 16) would
# compile the kernel again for layer 1, 16, 32... each on first use. The tables and lengths are views at
# any offset of the step's one metadata upload (engine/batch.py).
@triton.jit(
    do_not_specialize=["layer", "partition_tokens", "stride_bt", "stride_pb", "stride_ph"],
    do_not_specialize_on_alignment=["block_tables_ptr", "context_lens_ptr"],
)
def _decode_kernel(
    q_ptr,
    memory_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    layer,
    scale_log2,
    partition_tokens,
    stride_qb,
    stride_qh,
    stride_page,
    stride_layer,
    stride_part,
    stride_head,
    stride_off,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_pp,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = partition * partition_tokens
    # Partitions past this sequence's end have nothing to do; the merge never reads them.
    if start >= context_len:
        return
    end = tl.minimum(start + partition_tokens, context_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + g
    row_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=row_mask, other=0.0)
    q = q.to(DOT_DTYPE)

    keys_ptr = memory_ptr + layer * stride_layer + kv_head * stride_head
    values_ptr = keys_ptr + stride_part
    table_ptr = block_tables_ptr + seq * stride_bt

    # Scores are kept in log2 units (scaled by log2(e)) so the softmax can use exp2.
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(start, end, BLOCK_N):
        tokens = tile + n
        valid = tokens < end
        pages = tl.load(table_ptr + tokens // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        rows = pages * stride_page + (tokens % PAGE_SIZE) * stride_off  # [BLOCK_N]
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(keys_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        k = k.to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
        # Every tile holds at least one valid token, so m is finite from the first tile on.
        s = tl.where(valid[None, :], s, float("-inf"))
        v_ptrs = values_ptr + rows[:, None] + d[None, :]
        m, row_sum, acc = online_softmax_step(s, v_ptrs, kv_mask, m, row_sum, acc, DOT_DTYPE, PRECISION)

    out = acc / row_sum[:, None]
    if SPLIT:
        part_rows = seq * stride_pb + heads * stride_ph + partition * stride_pp  # [BLOCK_G]
        tl.store(part_out_ptr + part_rows[:, None] * BLOCK_D + d[None, :], out, mask=row_mask)
        tl.store(part_lse_ptr + part_rows, m + tl.log2(row_sum), mask=g < GROUP)
    else:
        out_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit(
    do_not_specialize=["partition_tokens", "stride_pb", "stride_ph"],
    do_not_specialize_on_alignment=["context_lens_ptr"],
)
def _merge_partitions_kernel(
    part_out_ptr,
    part_lse_ptr,
    context_lens_ptr,
    out_ptr,
    partition_tokens,
    stride_pb,
    stride_ph,
    stride_pp,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    num_partitions = tl.cdiv(context_len, partition_tokens)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    base = seq * stride_pb + head * stride_ph
    # Online merge in log2 units: each partition's output is already normalised by its own sum.
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for partition in range(0, num_partitions):
        row = base + partition * stride_pp
        lse = tl.load(part_lse_ptr + row)
        part = tl.load(part_out_ptr + row * BLOCK_D + d, mask=d_mask, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        total = total * alpha + weight
        acc = acc * alpha + weight * part
        m = m_new
    out = acc / total
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def _block_n(dtype: torch.dtype, device: torch.device) -> int:
    """Keys per step: float32's exact ("ieee") dots spill at 64 on sm_80 (ptxas -v through
    engine/aot.py), where 32 fit; on sm_90 32 spills more than 64 does."""
    target = gpu_target(device)
    if dtype == torch.float32 and target is not None and target.arch < 90:
        return BLOCK_N // 2
    return BLOCK_N


def choose_partition_tokens(batch: int, kv_heads: int, max_tokens: int, device: torch.device) -> int:
    """Tokens per split-K partition, or `max_tokens` (no split) when the unsplit grid already fills the GPU.

    `max_tokens` is an upper bound on every context (the block table's width times the page size), so
    choosing needs no device sync.
    """
    gpu = gpu_target(device)
    if gpu is None:
        return max_tokens
    programs = batch * kv_heads
    target = PROGRAMS_PER_SM * gpu.sms
    if programs >= target:
        return max_tokens
    starved = programs < gpu.sms  # fewer programs than SMs: most of the GPU would wait
    min_tokens = MIN_PARTITION_TOKENS_STARVED if starved else MIN_PARTITION_TOKENS
    splits = min(triton.cdiv(target, programs), max_tokens // min_tokens)
    if splits <= 1:
        return max_tokens
    return triton.cdiv(triton.cdiv(max_tokens, splits), BLOCK_N) * BLOCK_N


def paged_decode_attention(
    q: torch.Tensor,
    memory: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    partition_tokens: int | None = None,
) -> torch.Tensor:
    """One query token per sequence attending to that sequence's whole cached context (GQA).

    Shapes: q [B, heads, head_dim]; memory [num_pages, layers, 2, kv_heads, page_size, head_dim]
    (contiguous); block_tables [B, max_blocks] int64 (entries past a sequence's end may be any valid
    page); context_lens [B], every entry >= 1. Returns [B, heads, head_dim] in q.dtype.
    Semantics: out[b, h] = softmax(q[b, h] · K_b[g]^T * scale) V_b[g], g = h // (heads / kv_heads).
    partition_tokens: split-K partition size (a multiple of BLOCK_N); None chooses one for the device.
    """
    batch, heads, dim = q.shape
    _, _, _, kv_heads, page_size, _ = memory.shape
    assert memory.is_contiguous(), "the pool must be contiguous"
    assert q.stride(2) == 1, "head_dim must be the contiguous axis of q"
    assert heads % kv_heads == 0, "query heads must be a multiple of kv heads"
    group = heads // kv_heads
    out = torch.empty(batch, heads, dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    max_tokens = block_tables.shape[1] * page_size
    if partition_tokens is None:
        partition_tokens = choose_partition_tokens(batch, kv_heads, max_tokens, q.device)
    assert partition_tokens % BLOCK_N == 0 or partition_tokens >= max_tokens, "partitions must be whole tiles"
    num_partitions = triton.cdiv(max_tokens, partition_tokens)
    split = num_partitions > 1
    block_d = triton.next_power_of_2(dim)
    if split:
        part_out = torch.empty(batch, heads, num_partitions, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, heads, num_partitions, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused: the kernel writes straight to out
    _decode_kernel[(batch, kv_heads, num_partitions)](
        q,
        memory,
        block_tables,
        context_lens,
        out,
        part_out,
        part_lse,
        layer,
        scale * LOG2_E,
        partition_tokens,
        q.stride(0),
        q.stride(1),
        *memory.stride()[:5],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        heads * num_partitions,
        num_partitions,
        1,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=dim,
        BLOCK_D=block_d,
        PAGE_SIZE=page_size,
        BLOCK_N=_block_n(memory.dtype, q.device),
        SPLIT=split,
        **dot_options(memory.dtype),
        num_warps=4,
    )
    if split:
        _merge_partitions_kernel[(batch, heads)](
            part_out,
            part_lse,
            context_lens,
            out,
            partition_tokens,
            heads * num_partitions,
            num_partitions,
            1,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=dim,
            BLOCK_D=block_d,
        )
    return out
