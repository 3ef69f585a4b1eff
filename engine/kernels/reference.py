"""Plain-torch reference ops: the CPU path of the engine and the oracle of every kernel test.

The KV cache of one layer is a pair of tensors (keys, values) shaped [kv_heads, num_pages, page_size,
head_dim]. A token's slot is `page * page_size + offset`; a sequence's block table lists its pages in
order, so its i-th token lives in page `block_table[i // page_size]` at offset `i % page_size`.
Heads come first so that gathering a batch's pages yields [kv_heads, batch, tokens, head_dim] with no
further copy, and the attention matmuls run on it as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store new keys and values in their slots.

    Shapes: k_cache, v_cache [kv_heads, num_pages, page_size, head_dim]; k, v [T, kv_heads, head_dim];
    slots [T] int64.
    Semantics: k_cache[h].flat[slots[t]] = k[t, h] (and the same for v).
    """
    heads, pages, page_size, dim = k_cache.shape
    k_cache.view(heads, pages * page_size, dim).index_copy_(1, slots, k.transpose(0, 1))
    v_cache.view(heads, pages * page_size, dim).index_copy_(1, slots, v.transpose(0, 1))


def gather_pages(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """The cached rows of each sequence, padded to the widest block table.

    Shapes: cache [kv_heads, num_pages, page_size, head_dim]; block_tables [B, max_blocks] int64.
    Returns [kv_heads, B, max_blocks * page_size, head_dim].
    """
    heads, _, page_size, dim = cache.shape
    batch, max_blocks = block_tables.shape
    # index_select over whole pages is several times faster on the CPU than advanced indexing.
    rows = cache.flatten(2).index_select(1, block_tables.flatten())  # [heads, B * max_blocks, P * D]
    return rows.view(heads, batch, max_blocks * page_size, dim)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence attending to that sequence's whole cached context (GQA).

    Shapes: q [B, heads, head_dim]; caches [kv_heads, num_pages, page_size, head_dim];
    block_tables [B, max_blocks] int64 (entries past a sequence's end may be any valid page);
    context_lens [B] int64. Returns [B, heads, head_dim].
    Semantics: out[b, h] = softmax(q[b, h] · K_b[g]^T * scale) V_b[g], g = h // (heads / kv_heads),
    over the first context_lens[b] cached tokens of sequence b.
    """
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[0]
    keys = gather_pages(k_cache, block_tables)  # [kv_heads, B, L, D]
    values = gather_pages(v_cache, block_tables)
    query = q.view(batch, kv_heads, heads // kv_heads, dim).transpose(0, 1)  # [kv_heads, B, G, D]
    scores = torch.matmul(query, keys.transpose(-1, -2)).float() * scale  # [kv_heads, B, G, L]
    padding = torch.arange(keys.shape[2], device=q.device)[None, :] >= context_lens[:, None]  # [B, L]
    scores.masked_fill_(padding[None, :, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype)
    out = torch.matmul(probs, values)  # [kv_heads, B, G, D]
    return out.transpose(0, 1).reshape(batch, heads, dim)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's chunk of new tokens to its cached prefix and to itself.

    The chunk's keys and values must already be in the cache; the chunk holds the last `q.shape[0]` of
    the sequence's `context_len` tokens.
    Shapes: q [T, heads, head_dim]; block_table [num_blocks] int64. Returns [T, heads, head_dim].
    Semantics: out[i] = softmax(q[i] · K[:p_i+1]^T * scale) V[:p_i+1], p_i = context_len - T + i.
    """
    num_new = q.shape[0]
    keys = gather_pages(k_cache, block_table[None])[:, :, :context_len].transpose(
        0, 1
    )  # [1, kv_heads, ctx, D]
    values = gather_pages(v_cache, block_table[None])[:, :, :context_len].transpose(0, 1)
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
