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

import torch
import torch.nn.functional as F


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
