"""Plain-torch reference ops: the CPU path of the engine and the oracle of every kernel test.

The KV cache of one layer is a pair of tensors shaped [num_pages, page_size, kv_heads, head_dim]
(keys and values). A token's slot is `page * page_size + offset`; a sequence's block table lists its
pages in order, so its i-th token lives in page `block_table[i // page_size]` at offset `i % page_size`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store new keys and values in their slots.

    Shapes: k_cache, v_cache [num_pages, page_size, kv_heads, head_dim]; k, v [T, kv_heads, head_dim];
    slots [T] int64.
    Semantics: k_cache.flat[slots[t]] = k[t], v_cache.flat[slots[t]] = v[t].
    """
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def gather_kv(
    cache: torch.Tensor, block_tables: torch.Tensor
) -> torch.Tensor:
    """The cached rows of each sequence, padded to the longest block table.

    Shapes: cache [num_pages, page_size, kv_heads, head_dim]; block_tables [B, max_blocks] int64.
    Returns [B, kv_heads, max_blocks * page_size, head_dim] (a view over one gathered copy).
    """
    batch, max_blocks = block_tables.shape
    page_size = cache.shape[1]
    rows = cache[block_tables]  # [B, max_blocks, page_size, kv_heads, head_dim]
    return rows.view(batch, max_blocks * page_size, *cache.shape[2:]).transpose(1, 2)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence attending to that sequence's whole cached context (GQA).

    Shapes: q [B, heads, head_dim]; caches [num_pages, page_size, kv_heads, head_dim];
    block_tables [B, max_blocks] int64 (unused entries may hold any valid page); context_lens [B] int64.
    Returns [B, heads, head_dim].
    Semantics: out[b] = softmax(q[b] · K_b^T * scale) V_b over the first context_lens[b] cached tokens.
    """
    keys = gather_kv(k_cache, block_tables)  # [B, kv_heads, L, D]
    values = gather_kv(v_cache, block_tables)
    positions = torch.arange(keys.shape[2], device=q.device)
    mask = (positions[None, :] < context_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )  # [B, heads, 1, D]
    return out.squeeze(2)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's chunk of new tokens to its cached prefix and to itself.

    The chunk's keys and values must already be written to the cache; the chunk holds the last
    `q.shape[0]` of the sequence's `context_len` tokens.
    Shapes: q [T, heads, head_dim]; block_table [num_blocks] int64. Returns [T, heads, head_dim].
    Semantics: out[i] = softmax(q[i] · K[:p_i+1]^T * scale) V[:p_i+1], p_i = context_len - T + i.
    """
    num_new = q.shape[0]
    keys = gather_kv(k_cache, block_table[None])[:, :, :context_len]  # [1, kv_heads, ctx, D]
    values = gather_kv(v_cache, block_table[None])[:, :, :context_len]
    query = q.transpose(0, 1).unsqueeze(0)  # [1, heads, T, D]
    if num_new == context_len:
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        key_pos = torch.arange(context_len, device=q.device)
        query_pos = torch.arange(context_len - num_new, context_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # [T, ctx]
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
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
