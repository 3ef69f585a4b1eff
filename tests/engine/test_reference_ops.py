"""The paged attention references against dense attention computed one sequence at a time."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels import reference


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """q [T, H, D] at positions offset..offset+T-1; k, v [ctx, Hkv, D]. Plain softmax, float64."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("thd,chd->htc", q.double(), k) / q.shape[-1] ** 0.5
    positions = torch.arange(q.shape[0])[:, None] + offset
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > positions, float("-inf"))
    return torch.einsum("htc,chd->thd", scores.softmax(-1), v)


LAYERS, LAYER = 3, 1  # the sequences' cache lives in layer 1 of a 3-layer pool


def scattered_cache(lengths: list[int], kv_heads: int, dim: int, page_size: int, seed: int):
    """Random K/V per sequence, stored in pages placed at random across a pool full of other data."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // page_size) for n in lengths]
    num_pages = sum(blocks) + 5
    order = torch.randperm(num_pages, generator=gen).tolist()
    memory = torch.randn(num_pages, LAYERS, 2, kv_heads, page_size, dim, generator=gen)
    tables, keys, values, used = [], [], [], 0
    for n, b in zip(lengths, blocks, strict=True):
        table = order[used : used + b]
        used += b
        k = torch.randn(n, kv_heads, dim, generator=gen)
        v = torch.randn(n, kv_heads, dim, generator=gen)
        slots = torch.tensor([table[i // page_size] * page_size + i % page_size for i in range(n)])
        reference.write_kv(memory, LAYER, k, v, slots)
        tables.append(table)
        keys.append(k)
        values.append(v)
    return memory, tables, keys, values


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_decode_attention_matches_dense(heads: int, kv_heads: int, page_size: int) -> None:
    lengths = [1, 5, 16, 17, 40, 3]
    dim = 32
    memory, tables, keys, values = scattered_cache(lengths, kv_heads, dim, page_size, seed=heads)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lengths), heads, dim)
    out = reference.paged_decode_attention(q, memory, LAYER, block_tables, torch.tensor(lengths), dim**-0.5)
    for b, n in enumerate(lengths):
        expected = dense_attention(q[b : b + 1], keys[b], values[b], offset=n - 1)[0]
        torch.testing.assert_close(out[b].double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("context,new", [(7, 7), (20, 5), (33, 1), (48, 16)])
def test_prefill_attention_with_cached_prefix_matches_dense(context: int, new: int) -> None:
    heads, kv_heads, dim, page_size = 6, 2, 16, 4
    memory, tables, keys, values = scattered_cache([context], kv_heads, dim, page_size, seed=context)
    q = torch.randn(new, heads, dim)
    out = reference.prefill_attention(q, memory, LAYER, torch.tensor(tables[0]), context, dim**-0.5)
    expected = dense_attention(q, keys[0], values[0], offset=context - new)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_causal_attention_matches_dense() -> None:
    q, k, v = torch.randn(12, 4, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8)
    out = reference.causal_attention(q, k, v, 8**-0.5)
    torch.testing.assert_close(out.double(), dense_attention(q, k, v, 0), rtol=1e-5, atol=1e-5)


def test_write_kv_touches_only_its_slots() -> None:
    memory = torch.zeros(3, LAYERS, 2, 2, 4, 8)  # pages, layers, k/v, kv_heads, page_size, head_dim
    k, v = torch.ones(2, 2, 8), torch.full((2, 2, 8), 2.0)
    reference.write_kv(memory, LAYER, k, v, torch.tensor([5, 11]))  # page 1 offset 1, page 2 offset 3
    assert memory[1, LAYER, 0, :, 1].eq(1).all() and memory[2, LAYER, 0, :, 3].eq(1).all()
    assert memory[1, LAYER, 1, :, 1].eq(2).all() and memory[2, LAYER, 1, :, 3].eq(2).all()
    assert memory.sum() == 2 * 2 * 8 * (1 + 2)  # nothing else written, no other layer touched


@pytest.mark.parametrize("path", ["grouped gemm", "gemm per adapter", "matrices per row"])
@pytest.mark.parametrize(
    ("dtype", "stack_dtype"), [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)]
)
def test_grouped_lora_equals_the_column_masked_one(
    path: str, dtype: torch.dtype, stack_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lora_grouped (the CPU path) against lora_shrink_expand on the same adapters: ranks 1 to 16,
    tokens of three adapters interleaved, some tokens without an adapter; by torch's grouped GEMM, a
    GEMM per adapter, or each row's own matrices (decodes); with the stacks in x's dtype or widened to
    float32 beside bfloat16 activations (the CPU's choice)."""
    if path == "gemm per adapter":
        monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    gen = torch.Generator().manual_seed(0)
    ranks, width_in, width_out = [1, 16, 5], 64, 48
    slots = [2, -1, 0, 1, 1, 2, -1, 0, 2, 2]
    x = torch.randn(len(slots), width_in, generator=gen).to(dtype)
    a_list = [torch.randn(r, width_in, generator=gen).to(dtype) for r in ranks]
    b_list = [torch.randn(r, width_out, generator=gen).to(dtype) for r in ranks]
    columns = torch.zeros(len(slots), sum(ranks), dtype=dtype)
    starts = [0, 1, 17]
    for t, s in enumerate(slots):
        if s >= 0:
            columns[t, starts[s] : starts[s] + ranks[s]] = 1
    expected = torch.randn(len(slots), width_out, generator=gen).to(dtype)
    got = expected.clone()
    reference.lora_shrink_expand(x, expected, torch.cat(a_list), torch.cat(b_list), columns)

    rank = 16
    a = torch.zeros(3, width_in, rank, dtype=stack_dtype)
    b = torch.zeros(3, rank, width_out, dtype=stack_dtype)
    for i, r in enumerate(ranks):
        a[i, :, :r], b[i, :r] = a_list[i].t(), b_list[i]
    order = sorted((s, t) for t, s in enumerate(slots) if s >= 0)
    counts = [sum(1 for s, _ in order if s == i) for i in range(3)]
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    rows = torch.tensor([t for _, t in order])
    untouched = got[[1, 6]].clone()
    row_groups = torch.tensor([s for s, _ in order]) if path == "matrices per row" else None
    reference.lora_grouped(x, got, a, b, rows, offsets, counts, row_groups)
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    assert torch.equal(got[[1, 6]], untouched)  # tokens without an adapter are not touched
