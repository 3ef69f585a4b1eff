"""Plain-torch reference ops: the CPU path of the engine and the oracle of every kernel test.

The pool is one page-major tensor `memory` [num_pages, layers, 2, kv_heads, page_size, head_dim]
(2: keys, values). A token's slot is `page * page_size + offset`; a sequence's block table lists its
pages in order, so its i-th token lives in page `block_table[i // page_size]` at offset
`i % page_size`. Reads and writes address the pool as rows of `head_dim` (or blocks of
`page_size * head_dim`) through computed indices: one row gather copies whole
[page_size, head_dim] blocks, and lays them out heads first ([kv_heads, batch, tokens, head_dim]) so the
attention matmuls use them with no further copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # the fields the kernels read of engine/model/quant.py's format (no Triton at run time)
    from .lora_meta import LoRAKernelMeta
    from .quant_matmul import QuantizedWeight


def _block_rows(memory: torch.Tensor, layer: int, part: int, pages: torch.Tensor) -> torch.Tensor:
    """Row numbers, in memory viewed as [num_pages * layers * 2 * kv_heads, page_size * head_dim], of
    the (head, page) blocks of one layer's keys (part 0) or values (part 1): [kv_heads, len(pages)]."""
    _, layers, _, heads, _, _ = memory.shape
    heads_range = torch.arange(heads, device=pages.device)
    return (pages * (layers * 2 * heads) + (layer * 2 + part) * heads)[None, :] + heads_range[:, None]


def write_kv(memory: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store new keys and values of one layer in their slots.

    Shapes: memory [num_pages, layers, 2, kv_heads, page_size, head_dim]; k, v [T, kv_heads, head_dim];
    slots [T] int64.
    Semantics: memory[slots[t] // P, layer, 0, h, slots[t] % P] = k[t, h] (1 and v for values).
    """
    page_size, dim = memory.shape[4], memory.shape[5]
    rows = memory.view(-1, dim)  # [num_pages * layers * 2 * kv_heads * page_size, head_dim]
    pages, offsets = slots // page_size, slots % page_size
    for part, new in ((0, k), (1, v)):
        block = _block_rows(memory, layer, part, pages)  # [kv_heads, T]
        rows.index_copy_(
            0, (block * page_size + offsets[None, :]).flatten(), new.transpose(0, 1).flatten(0, 1)
        )


def gather_pages(memory: torch.Tensor, layer: int, part: int, block_tables: torch.Tensor) -> torch.Tensor:
    """One layer's cached keys (part 0) or values (part 1) of each sequence, padded to the widest table.

    Shapes: block_tables [B, max_blocks] int64. Returns [kv_heads, B, max_blocks * page_size, head_dim].
    """
    heads, page_size, dim = memory.shape[3], memory.shape[4], memory.shape[5]
    batch, max_blocks = block_tables.shape
    blocks = memory.view(-1, page_size * dim)
    # A row gather of whole blocks from a contiguous 2-D view; embedding's kernel is the fastest of
    # torch's gathers for it on the CPU (measured against index_select and advanced indexing).
    rows = F.embedding(_block_rows(memory, layer, part, block_tables.flatten()).flatten(), blocks)
    return rows.view(heads, batch, max_blocks * page_size, dim)


def paged_decode_attention(
    q: torch.Tensor,
    memory: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence attending to that sequence's whole cached context (GQA).

    Shapes: q [B, heads, head_dim]; block_tables [B, max_blocks] int64 (entries past a sequence's end
    may be any valid page); context_lens [B] int64. Returns [B, heads, head_dim].
    Semantics: out[b, h] = softmax(q[b, h] · K_b[g]^T * scale) V_b[g], g = h // (heads / kv_heads),
    over the first context_lens[b] cached tokens of sequence b in this layer.
    """
    batch, heads, dim = q.shape
    kv_heads = memory.shape[3]
    keys = gather_pages(memory, layer, 0, block_tables)  # [kv_heads, B, L, D]
    values = gather_pages(memory, layer, 1, block_tables)
    query = q.view(batch, kv_heads, heads // kv_heads, dim).transpose(0, 1)  # [kv_heads, B, G, D]
    scores = torch.matmul(query, keys.transpose(-1, -2)).float() * scale  # [kv_heads, B, G, L]
    padding = torch.arange(keys.shape[2], device=q.device)[None, :] >= context_lens[:, None]  # [B, L]
    scores.masked_fill_(padding[None, :, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype)
    out = torch.matmul(probs, values)  # [kv_heads, B, G, D]
    return out.transpose(0, 1).reshape(batch, heads, dim)


def prefill_attention(
    q: torch.Tensor,
    memory: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's chunk of new tokens to its cached prefix and to itself.

    The chunk's keys and values must already be in the pool; the chunk holds the last `q.shape[0]` of
    the sequence's `context_len` tokens.
    Shapes: q [T, heads, head_dim]; block_table [num_blocks] int64. Returns [T, heads, head_dim].
    Semantics: out[i] = softmax(q[i] · K[:p_i+1]^T * scale) V[:p_i+1], p_i = context_len - T + i.
    """
    num_new = q.shape[0]
    table = block_table[None]
    keys = gather_pages(memory, layer, 0, table)[:, :, :context_len].transpose(0, 1)  # [1, kv_heads, ctx, D]
    values = gather_pages(memory, layer, 1, table)[:, :, :context_len].transpose(0, 1)
    key_pos = torch.arange(context_len, device=q.device)
    query_pos = torch.arange(context_len - num_new, context_len, device=q.device)
    mask = key_pos[None, :] <= query_pos[:, None]  # [T, ctx]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal self-attention of a sequence with no cached prefix, straight from its new k and v.

    Shapes: q [T, heads, D]; k, v [T, kv_heads, D]. Returns [T, heads, D].
    """
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def gather_rows(pool_rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Matrices stored as runs of pool rows: index [..., rows, width / head_dim] -> [..., rows, width].

    Shapes: pool_rows [N, head_dim] (the pool as rows); index int64 pool row numbers.
    """
    gathered = F.embedding(index.flatten(), pool_rows)  # [numel, head_dim]
    return gathered.view(*index.shape[:-1], index.shape[-1] * pool_rows.shape[1])


def lora_shrink_expand(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_columns: torch.Tensor
) -> None:
    """Add every token's own adapter delta to a projection's output, in place.

    Shapes: x [T, in]; y [T, out]; a [C, in] and b [C, out]: the stacked A rows and scaled B^T rows of
    the step's adapters (adapter u owns a block of C's columns, its rank summed over the group's
    modules); token_columns [T, C], 1 where the column belongs to the token's adapter, else 0 (a token
    without an adapter has a zero row).
    Semantics: y[i] += scale[a] * (x[i] @ A[a].T) @ B[a].T  where a = adapter_of_token[i]
    (scale is folded into b).
    """
    shrunk = torch.matmul(x, a.t()) * token_columns  # [T, C]
    y.addmm_(shrunk, b)


# Multi-adapter LoRA over the pool (the oracle of the lora_shrink / lora_expand kernels).
#
# A step's adapters are numbered by slot u; for one layer and projection group their rows are stacked
# (slot u owns rows slot_start[u] .. slot_start[u] + slot_rank[u] - 1, ranks of different adapters
# differ). Stacked row c has an A row of width `in` that starts at pool row a_starts[c], and a scaled B^T
# row of width b_widths[c] that starts at pool row b_starts[c] and lands in columns b_cols[c] onward of
# the group's output (each module of the group has its own column block; width 0 marks a padding row).
# Tokens name their slot per token (token_slot, -1: no adapter) or per contiguous segment. All of it
# comes in one LoRAKernelMeta (lora_meta.py), its tables indexed by layer, as the kernels take it.


def segment_token_slots(seg_starts: torch.Tensor, seg_slot: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Per-token slots of a segment batch: tokens seg_starts[g] .. seg_starts[g + 1] - 1 use seg_slot[g].

    Shapes: seg_starts [G + 1] int (non-decreasing; empty segments allowed); seg_slot [G] int.
    Returns token_slot [num_tokens] int32, -1 for tokens of no segment or of a slot -1 segment.
    """
    tokens = torch.arange(num_tokens, device=seg_starts.device)
    starts = seg_starts.long()
    # The last segment starting at or before the token: among equal starts (empty segments) that is the
    # one the token is actually in.
    segment = torch.searchsorted(starts, tokens, right=True) - 1
    inside = (segment >= 0) & (tokens < starts[-1])
    slots = seg_slot.long()[segment.clamp(0, max(len(seg_slot) - 1, 0))] if len(seg_slot) else segment
    return torch.where(inside, slots, torch.full_like(slots, -1)).to(torch.int32)


def _token_rows(
    slot_start: torch.Tensor, slot_rank: torch.Tensor, token_slot: torch.Tensor, max_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's stacked rows: (rows [T, R] int64, valid [T, R] bool); invalid entries point at row 0."""
    has = token_slot >= 0
    slot = token_slot.long().clamp(min=0)
    r = torch.arange(max_rank, device=token_slot.device)
    rank = torch.where(has, slot_rank.long()[slot], 0) if len(slot_rank) else torch.zeros_like(slot)
    first = slot_start.long()[slot] if len(slot_start) else torch.zeros_like(slot)
    valid = r[None, :] < rank[:, None]
    return torch.where(valid, first[:, None] + r[None, :], 0), valid


def _shrink(
    x: torch.Tensor,
    pool_rows: torch.Tensor,
    a_starts: torch.Tensor,
    slot_start: torch.Tensor,
    slot_rank: torch.Tensor,
    token_slot: torch.Tensor,
    rank: int,
) -> torch.Tensor:
    """lora_shrink_tokens on one layer's a_starts [C]."""
    in_width, head_dim = x.shape[1], pool_rows.shape[1]
    if rank == 0 or len(a_starts) == 0:
        return torch.zeros(x.shape[0], rank, dtype=torch.float32, device=x.device)
    index = a_starts.long()[:, None] * head_dim + torch.arange(in_width, device=x.device)[None, :]
    a = pool_rows.reshape(-1)[index].float()  # [C, in]
    every = x.float() @ a.t()  # [T, C]: each token against every stacked row, then keep its own
    rows, valid = _token_rows(slot_start, slot_rank, token_slot, rank)
    return torch.where(valid, every.gather(1, rows), 0.0)


def lora_shrink_tokens(
    x: torch.Tensor, pool_rows: torch.Tensor, meta: LoRAKernelMeta, layer: int
) -> torch.Tensor:
    """Every token's x times its adapter's stacked A rows of layer `layer`.

    Shapes: x [T, in]; pool_rows [N, head_dim] (contiguous); meta (lora_meta.py) with token_slot [T]
    (-1: no adapter). Returns float32 [T, R], R = meta.rank(); with a = meta.a_starts[layer]:
    out[t, r] = sum_k x[t, k] * pool[a[slot_start[u] + r] * head_dim + k] for r < slot_rank[u],
    u = token_slot[t]; 0 elsewhere (tokens without an adapter, columns past the adapter's rank).
    """
    return _shrink(
        x, pool_rows, meta.a_starts[layer], meta.slot_start, meta.slot_rank, meta.tokens(), meta.rank()
    )


def lora_shrink_segments(
    x: torch.Tensor, pool_rows: torch.Tensor, meta: LoRAKernelMeta, layer: int
) -> torch.Tensor:
    """lora_shrink_tokens with the slots given per segment (meta.seg_starts [G + 1], seg_slot [G])."""
    seg_starts, seg_slot, _ = meta.segments()  # the longest segment is a launch hint of the kernel
    token_slot = segment_token_slots(seg_starts, seg_slot, x.shape[0])
    return _shrink(
        x, pool_rows, meta.a_starts[layer], meta.slot_start, meta.slot_rank, token_slot, meta.rank()
    )


def _expand(
    y: torch.Tensor,
    shrunk: torch.Tensor,
    pool_rows: torch.Tensor,
    meta: LoRAKernelMeta,
    layer: int,
    token_slot: torch.Tensor,
) -> None:
    """lora_expand_tokens with the slots given as token_slot [T]."""
    rank = shrunk.shape[1]
    b_starts, b_cols, b_widths = meta.b_starts[layer], meta.b_cols[layer], meta.b_widths[layer]
    if rank == 0 or len(b_starts) == 0:
        return
    head_dim = pool_rows.shape[1]
    column = torch.arange(y.shape[1], device=y.device)
    offset = column[None, :] - b_cols.long()[:, None]  # [C, out]: position inside the row's module
    inside = (offset >= 0) & (offset < b_widths.long()[:, None])
    index = b_starts.long()[:, None] * head_dim + offset.clamp(min=0)
    b = torch.where(inside, pool_rows.reshape(-1)[index.clamp(max=pool_rows.numel() - 1)].float(), 0.0)
    rows, valid = _token_rows(meta.slot_start, meta.slot_rank, token_slot, rank)
    coefficients = torch.zeros(y.shape[0], len(b_starts), dtype=torch.float32, device=y.device)
    coefficients.scatter_add_(1, rows, torch.where(valid, shrunk.float(), 0.0))  # [T, C]
    updated = (y.float() + coefficients @ b).to(y.dtype)
    y.copy_(torch.where(valid.any(dim=1, keepdim=True), updated, y))


def lora_expand_tokens(
    y: torch.Tensor, shrunk: torch.Tensor, pool_rows: torch.Tensor, meta: LoRAKernelMeta, layer: int
) -> None:
    """Add every token's shrunk activations times its adapter's scaled B^T rows of layer `layer` to y,
    in place.

    Shapes: y [T, out]; shrunk [T, R] (lora_shrink_*'s output); pool_rows [N, head_dim] (contiguous);
    meta (lora_meta.py) with token_slot [T] (-1: none). With b_starts, b_cols, b_widths the layer's
    rows of meta's tables:
    Semantics: y[t, n] += sum_{r < rank_u} shrunk[t, r] * pool[b_starts[c] * head_dim + n - b_cols[c]]
    over c = slot_start[u] + r with b_cols[c] <= n < b_cols[c] + b_widths[c], u = token_slot[t],
    summed in float32 and cast to y.dtype. Rows of tokens without an adapter, or whose adapter has
    rank 0 in this group, are left untouched.
    """
    _expand(y, shrunk, pool_rows, meta, layer, meta.tokens())


def lora_expand_segments(
    y: torch.Tensor, shrunk: torch.Tensor, pool_rows: torch.Tensor, meta: LoRAKernelMeta, layer: int
) -> None:
    """lora_expand_tokens with the slots given per segment (meta.seg_starts [G + 1], seg_slot [G])."""
    seg_starts, seg_slot, _ = meta.segments()  # the longest segment is a launch hint of the kernel
    _expand(y, shrunk, pool_rows, meta, layer, segment_token_slots(seg_starts, seg_slot, y.shape[0]))


def _dora_scale(
    y: torch.Tensor, pool_rows: torch.Tensor, meta: LoRAKernelMeta, layer: int, token_slot: torch.Tensor
) -> None:
    """lora_dora_scale_tokens with the slots given as token_slot [T]."""
    if meta.d_starts is None:
        raise ValueError("the DoRA scale needs meta.d_starts (the step holds no DoRA adapter)")
    d_starts = meta.d_starts[layer].long()
    has = token_slot >= 0
    slot = token_slot.long().clamp(min=0)
    if len(meta.slot_rank) == 0:
        return
    d_row = torch.where(has & (meta.slot_rank.long()[slot] > 0), d_starts[meta.slot_start.long()[slot]], 0)
    rows = torch.arange(y.shape[1] // pool_rows.shape[1], device=d_row.device)
    h = gather_rows(pool_rows, (d_row[:, None] + rows).clamp(min=0))
    scaled = (y.float() * (1 + h.float())).to(y.dtype)
    y.copy_(torch.where((d_row != 0)[:, None], scaled, y))


def lora_dora_scale_tokens(
    y: torch.Tensor, pool_rows: torch.Tensor, meta: LoRAKernelMeta, layer: int
) -> None:
    """Multiply, in place, each row of y whose adapter is a DoRA one by 1 + its g - 1 of layer `layer`.

    Shapes: y [T, out]; pool_rows [N, head_dim]; meta with token_slot [T] (-1: none) and d_starts [L, C].
    Semantics: with d = d_starts[layer, slot_start[u]], u = token_slot[t]:
    y[t, n] = y[t, n] * (1 + pool[d * head_dim + n]) in float32, cast to y.dtype, where d != 0 and
    slot_rank[u] > 0; other rows untouched.
    """
    _dora_scale(y, pool_rows, meta, layer, meta.tokens())


def lora_dora_scale_segments(
    y: torch.Tensor, pool_rows: torch.Tensor, meta: LoRAKernelMeta, layer: int
) -> None:
    """lora_dora_scale_tokens with the slots given per segment (meta.seg_starts [G + 1], seg_slot [G])."""
    seg_starts, seg_slot, _ = meta.segments()
    _dora_scale(y, pool_rows, meta, layer, segment_token_slots(seg_starts, seg_slot, y.shape[0]))


def prefill_attention_varlen(
    q: torch.Tensor,
    memory: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`prefill_attention` of several sequences' chunks packed back to back in q.

    Shapes: q [T, heads, head_dim]; block_tables [S, max_blocks] int64; q_starts [S + 1] (q_starts[0] = 0,
    q_starts[S] = T); context_lens [S]. Returns [T, heads, head_dim].
    Semantics: rows q_starts[s]..q_starts[s+1]-1 are the last tokens of sequence s's context_lens[s]
    tokens, attending causally to that sequence's cache.
    """
    starts, lens = q_starts.tolist(), context_lens.tolist()
    parts = [
        prefill_attention(q[starts[s] : starts[s + 1]], memory, layer, block_tables[s], lens[s], scale)
        for s in range(len(lens))
    ]
    return torch.cat(parts) if parts else q.new_empty(q.shape)


def grouped_matmul(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, counts: list[int]
) -> torch.Tensor:
    """Each row block of x times its own matrix: rows [offsets[g-1], offsets[g]) of x times w[g].

    Shapes: x [T, K]; w [G, K, N]; offsets [G] int32 cumulative row ends; counts the G block sizes
    (on the host). Returns [T, N]. torch's grouped GEMM when it takes these shapes and dtypes (one
    call, no padding of the rows), else one matmul per block.
    """
    if hasattr(torch, "_grouped_mm"):
        try:
            return torch._grouped_mm(x, w, offs=offsets)
        except RuntimeError:  # e.g. strides it cannot use for this dtype: fall through
            pass
    return torch.cat([block @ w[g] for g, block in enumerate(x.split(counts))])


def lora_grouped(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    order: torch.Tensor | None,
    offsets: torch.Tensor,
    counts: list[int],
    row_groups: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> None:
    """Add every token's own adapter delta to a projection's output, in place, adapter by adapter.

    Shapes: x [T, in]; y [T, out]; a [G, in, R] and b [G, R, out]: the A^T and scaled B^T of the G
    adapters in the step that adapt this projection, their ranks zero-padded to R; order [T_a] the
    rows of the tokens with one of those adapters, grouped by adapter (None: all T rows, in order);
    offsets / counts the groups' row ends / sizes within order.
    Semantics: y[t] += (x[t] @ a[g]) @ b[g] for each token t of adapter g. The cost follows the
    tokens' own ranks, not the sum of all the step's ranks as lora_shrink_expand's does.
    `row_groups` [T_a] (each row's adapter, 0..G-1): the rows are few per adapter (decodes), so each
    row takes its own matrices in one batched matmul, where a grouped GEMM of one or two rows per group
    costs 3-6x more on the CPU. a and b may be float32 beside 16-bit x and y (the CPU computes the
    small matrices faster that way): the delta is computed in their dtype and rounded once into y.
    `scale` [G, out] (DoRA, engine/lora/dora.py): each adapter's g - 1 per output column (0 for plain
    LoRA adapters); then y[t] = (y[t] + delta) * (1 + scale[g]) for each token t of adapter g, computed
    in a's dtype and rounded once (each adapter's block of rows scaled by its own row, broadcast).
    """
    rows = x if order is None else x.index_select(0, order)
    rows = rows.to(a.dtype)
    if row_groups is not None:
        shrunk = torch.bmm(rows.unsqueeze(1), a.index_select(0, row_groups))  # [T_a, 1, R]
        delta = torch.bmm(shrunk, b.index_select(0, row_groups)).squeeze(1)
    else:
        delta = grouped_matmul(grouped_matmul(rows, a, offsets, counts), b, offsets, counts)
    if scale is not None:
        base = y if order is None else y.index_select(0, order)
        scaled = delta.add_(base.to(delta.dtype))  # delta is this call's own tensor: reused in place
        begin = 0
        for group, count in enumerate(counts):  # the rows are grouped by adapter, counts[g] each
            scaled[begin : begin + count].mul_(1 + scale[group].to(delta.dtype))
            begin += count
        if order is None:
            y.copy_(scaled.to(y.dtype))
        else:
            y.index_copy_(0, order, scaled.to(y.dtype))
        return
    if order is None:
        y.add_(delta.to(y.dtype))
    else:
        y.index_add_(0, order, delta.to(y.dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row [..., hidden], exactly as Hugging Face's LlamaRMSNorm.

    Semantics: out = weight * (x / sqrt(mean(x^2) + eps)), normalised in float32 and cast back to x's
    dtype before the weight.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: (hidden + delta, rms_norm(hidden + delta))."""
    hidden = hidden + delta
    return hidden, rms_norm(hidden, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation of the fused [T, 2 I] gate_up output: silu(gate) * up, [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by its positions' cos, sin [T, 1, D] (rotate-half convention, as Hugging
    Face Llama, so outputs match bit for bit)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def rotary_write_kv(
    memory: torch.Tensor,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Rotate q and k in place (cos, sin [T, 1, head_dim]), then store k and v as `write_kv` does."""
    q.copy_(apply_rotary(q, cos, sin))
    k.copy_(apply_rotary(k, cos, sin))
    write_kv(memory, layer, k, v, slots)


def weight_only_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """W8A16 / W4A16 (quant_matmul.py): x [..., K] @ the dequantized weight's transpose, in x's dtype.
    The weight is dequantized in float32 and rounded to x's dtype first, as the kernels do: int8 codes
    times their row's scale; int4 codes (even column in the low nibble) times their group's scale plus
    its offset."""
    if w.kind == "int8":
        dense = w.qweight.float() * w.scales.float()[:, None]
    else:
        assert w.zeros is not None
        codes = torch.stack((w.qweight & 0x0F, w.qweight >> 4), dim=-1).reshape(w.out_features, -1)
        grouped = codes.float().view(w.out_features, -1, w.group_size)  # [N, K/G, G]
        dense = grouped * w.scales.float()[..., None] + w.zeros.float()[..., None]
        dense = dense.view(w.out_features, w.in_features)
    return x @ dense.to(x.dtype).T
