"""The Triton attention kernels (paged decode, paged prefill, KV write) against the torch references.

On a machine without a GPU the kernels run under TRITON_INTERPRET=1 (set by tests/conftest.py), so
shapes are kept small; they still cover partial pages and tiles, GQA ratios 1/3/4/8, head_dim 64
and 128, page sizes 8/16/32, shuffled pages and padded block tables. Float32 is compared tightly (a
token too many or too few moves the output far more than the tolerance); bfloat16 checks the dtype
handling against the float32 reference of the same rounded inputs.
"""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels import paged_decode_attention as decode_module
from loraplex.engine.kernels import reference
from loraplex.engine.kernels.gpu import H100, targeting
from loraplex.engine.kernels.paged_decode_attention import choose_partition_tokens, paged_decode_attention
from loraplex.engine.kernels.prefill_attention import prefill_attention, prefill_attention_varlen
from loraplex.engine.kernels.write_kv import write_kv

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # atol and rtol by the kernel's dtype
# (heads, kv_heads, head_dim): GQA ratios 1, 3 (SmolLM2), 4 and 8.
HEAD_SHAPES = [
    pytest.param(4, 4, 128, id="mha-d128"),
    pytest.param(9, 3, 64, id="gqa3-d64"),
    pytest.param(8, 2, 128, id="gqa4-d128"),
    pytest.param(8, 1, 64, id="gqa8-d64"),
]
LAYERS, LAYER = 3, 1  # a middle layer, so a wrong layer stride reads other layers' data


def paged_pool(
    context_lens: list[int],
    page_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random pool holding each sequence's pages at shuffled places, no page shared, and block tables
    one column wider than the longest needs, padded with random valid pages (other sequences' too).

    Returns memory [num_pages, LAYERS, 2, kv_heads, page_size, head_dim] and block_tables [S, width].
    """
    generator = torch.Generator().manual_seed(seed)
    blocks = [-(-n // page_size) for n in context_lens]
    num_pages = sum(blocks) + 3
    memory = torch.randn(num_pages, LAYERS, 2, kv_heads, page_size, head_dim, generator=generator)
    order = torch.randperm(num_pages, generator=generator)
    tables = torch.randint(0, num_pages, (len(context_lens), max(blocks) + 1), generator=generator)
    taken = 0
    for seq, count in enumerate(blocks):
        tables[seq, :count] = order[taken : taken + count]
        taken += count
    return memory.to(dtype).to(device), tables.to(device)


def random_queries(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype).to(device)


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def check_decode(
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    context_lens: list[int],
    dtype: torch.dtype,
    device: torch.device,
    partition_tokens: int | None = None,
) -> None:
    memory, tables = paged_pool(context_lens, page_size, kv_heads, head_dim, dtype, device)
    q = random_queries((len(context_lens), heads, head_dim), dtype, device)
    lens = torch.tensor(context_lens, device=device)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, memory, LAYER, tables, lens, scale, partition_tokens=partition_tokens)
    expected = reference.paged_decode_attention(q.float(), memory.float(), LAYER, tables, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert_matches(out, expected, dtype)


def check_prefill_varlen(
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    context_lens: list[int],
    chunk_lens: list[int],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    heads, kv_heads = interpreted_heads(heads, kv_heads, device)
    memory, tables = paged_pool(context_lens, page_size, kv_heads, head_dim, dtype, device)
    q = random_queries((sum(chunk_lens), heads, head_dim), dtype, device)
    q_starts = torch.tensor([0, *chunk_lens], device=device).cumsum(0)
    lens = torch.tensor(context_lens, device=device)
    scale = head_dim**-0.5
    out = prefill_attention_varlen(q, memory, LAYER, tables, q_starts, lens, scale)
    expected = reference.prefill_attention_varlen(
        q.float(), memory.float(), LAYER, tables, q_starts, lens, scale
    )
    assert out.dtype == dtype and out.shape == q.shape
    assert_matches(out, expected, dtype)


def check_prefill(
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    context_len: int,
    chunk_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    heads, kv_heads = interpreted_heads(heads, kv_heads, device)
    memory, tables = paged_pool([context_len], page_size, kv_heads, head_dim, dtype, device)
    q = random_queries((chunk_len, heads, head_dim), dtype, device)
    scale = head_dim**-0.5
    out = prefill_attention(q, memory, LAYER, tables[0], context_len, scale)
    expected = reference.prefill_attention(q.float(), memory.float(), LAYER, tables[0], context_len, scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert_matches(out, expected, dtype)


def interpreted_heads(heads: int, kv_heads: int, device: torch.device) -> tuple[int, int]:
    """A model's head counts on a GPU. Under the CPU interpreter, which runs every program of the grid one
    after the other in Python, at most two kv heads at the same GQA ratio: each kv head is its own programs
    running the same code, and two still catch a kv head read at another's offset. The prefill checks
    shrink their heads this way; the AOT gate (test_aot.py) still compiles every variant at full size."""
    if device.type == "cuda":
        return heads, kv_heads
    kept = min(kv_heads, 2)
    return kept * (heads // kv_heads), kept


# --- decode ---


@pytest.mark.parametrize("page_size", [8, 16, 32])
def test_decode_lengths_around_page_edges(page_size, device):
    lens = [1, page_size - 1, page_size, page_size + 1, 300, 2]
    check_decode(9, 3, 64, page_size, lens, torch.float32, device)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), HEAD_SHAPES)
def test_decode_gqa_ratios(heads, kv_heads, head_dim, device):
    check_decode(heads, kv_heads, head_dim, 16, [1, 17, 200, 64], torch.float32, device)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [HEAD_SHAPES[1], HEAD_SHAPES[2]])
def test_decode_bfloat16(heads, kv_heads, head_dim, device):
    check_decode(heads, kv_heads, head_dim, 16, [1, 16, 17, 150], torch.bfloat16, device)


@pytest.mark.parametrize("partition_tokens", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_split_k(partition_tokens, dtype, device):
    # Short sequences leave most partitions empty; 300 ends mid-partition, 128 and 64 on an edge.
    check_decode(9, 3, 64, 16, [1, 63, 64, 65, 300, 128], dtype, device, partition_tokens=partition_tokens)


def test_decode_reads_q_through_its_strides(device):
    # Queries as the runner may hand them: the first columns of a packed qkv projection.
    heads, kv_heads, dim, lens = 8, 2, 64, [5, 40]
    memory, tables = paged_pool(lens, 16, kv_heads, dim, torch.float32, device)
    qkv = random_queries((len(lens), (heads + 2 * kv_heads) * dim), torch.float32, device)
    q = qkv[:, : heads * dim].view(len(lens), heads, dim)
    context_lens = torch.tensor(lens, device=device)
    out = paged_decode_attention(q, memory, LAYER, tables, context_lens, 0.125)
    expected = reference.paged_decode_attention(q.contiguous(), memory, LAYER, tables, context_lens, 0.125)
    assert_matches(out, expected, torch.float32)


def test_choose_partition_tokens_splits_only_an_underfilled_gpu():
    gpu = torch.device("meta")  # answers as the GPU `targeting` names (engine/kernels/gpu.py)
    with targeting(H100):
        # Enough (sequence, kv head) programs to fill the GPU already: no split.
        filling_batch = decode_module.PROGRAMS_PER_SM * H100.sms // 8
        assert choose_partition_tokens(filling_batch, 8, 4096, gpu) == 4096
        assert choose_partition_tokens(filling_batch - 1, 8, 4096, gpu) < 4096
        # More programs than SMs (20 x 8 = 160): partitions of at least MIN_PARTITION_TOKENS.
        tokens = choose_partition_tokens(20, 8, 4096, gpu)
        assert tokens < 4096 and tokens % decode_module.BLOCK_N == 0
        assert tokens >= decode_module.MIN_PARTITION_TOKENS
        assert choose_partition_tokens(20, 8, 300, gpu) == 300  # too short to be worth splitting
        # One sequence, 8 kv heads on 132 SMs: even a context below 512 tokens is split (320 tokens
        # into two partitions of whole tiles), but never below MIN_PARTITION_TOKENS_STARVED.
        assert choose_partition_tokens(1, 8, 320, gpu) == 192
        assert choose_partition_tokens(1, 8, 4096, gpu) >= decode_module.MIN_PARTITION_TOKENS_STARVED
        assert choose_partition_tokens(1, 8, 200, gpu) == 200
    assert choose_partition_tokens(1, 8, 4096, torch.device("cpu")) == 4096
    assert choose_partition_tokens(1, 8, 4096, gpu) == 4096  # a meta device outside `targeting`


@pytest.mark.slow
def test_decode_llama3_8b_shapes(device):
    # 32 heads over 8 kv heads, head_dim 128; long contexts, unsplit and split. The interpreter runs two
    # kv heads at the same GQA ratio (interpreted_heads).
    heads, kv_heads = interpreted_heads(32, 8, device)
    lens = [1, 33, 700, 1000]
    check_decode(heads, kv_heads, 128, 16, lens, torch.bfloat16, device)
    check_decode(heads, kv_heads, 128, 16, lens, torch.float32, device, partition_tokens=256)


# --- prefill ---


@pytest.mark.parametrize("chunk_len", [1, 37, 64, 100])
def test_prefill_without_prefix(chunk_len, device):
    # 37 and 100 end mid-tile, 64 is exactly one query tile.
    check_prefill(9, 3, 64, 16, chunk_len, chunk_len, torch.float32, device)


@pytest.mark.parametrize(("context_len", "chunk_len"), [(400, 37), (300, 64), (129, 128), (250, 1)])
def test_prefill_after_a_long_prefix(context_len, chunk_len, device):
    check_prefill(9, 3, 64, 16, context_len, chunk_len, torch.float32, device)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), HEAD_SHAPES)
def test_prefill_gqa_ratios(heads, kv_heads, head_dim, device):
    check_prefill(heads, kv_heads, head_dim, 16, 150, 70, torch.float32, device)


@pytest.mark.parametrize("page_size", [8, 32])
def test_prefill_page_sizes(page_size, device):
    check_prefill(9, 3, 64, page_size, 100, 45, torch.float32, device)


def test_prefill_bfloat16(device):
    check_prefill(9, 3, 64, 16, 150, 70, torch.bfloat16, device)


def test_prefill_varlen_batch(device):
    # Fresh chunks, chunks after a prefix, a one-token chunk, chunk lengths on and off the tile.
    context_lens = [40, 300, 17, 1, 90, 64]
    chunk_lens = [40, 70, 3, 1, 90, 64]
    check_prefill_varlen(9, 3, 64, 16, context_lens, chunk_lens, torch.float32, device)


def test_prefill_varlen_batch_bfloat16(device):
    check_prefill_varlen(8, 2, 128, 16, [30, 120], [30, 50], torch.bfloat16, device)


def test_prefill_varlen_max_chunk_len_hint(device):
    # The hint only shrinks the grid: the result must not change.
    context_lens = [100, 20]  # chunks of 70 and 20 tokens
    memory, tables = paged_pool(context_lens, 16, 3, 64, torch.float32, device)
    q = random_queries((90, 9, 64), torch.float32, device)
    q_starts = torch.tensor([0, 70, 90], device=device)
    lens = torch.tensor(context_lens, device=device)
    hinted = prefill_attention_varlen(q, memory, LAYER, tables, q_starts, lens, 0.125, max_chunk_len=70)
    unhinted = prefill_attention_varlen(q, memory, LAYER, tables, q_starts, lens, 0.125)
    expected = reference.prefill_attention_varlen(q, memory, LAYER, tables, q_starts, lens, 0.125)
    assert_matches(hinted, expected, torch.float32)
    torch.testing.assert_close(unhinted, hinted, rtol=0, atol=0)


@pytest.mark.slow
def test_prefill_llama_7b_shapes(device):
    # 32 heads, no GQA, head_dim 128: a long chunk after a long prefix, in bfloat16 (interpreted: 2 heads).
    check_prefill(32, 32, 128, 16, 400, 100, torch.bfloat16, device)


# --- write_kv ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_heads", "head_dim", "page_size"), [(3, 64, 16), (8, 128, 8)])
def test_write_kv_matches_reference(kv_heads, head_dim, page_size, dtype, device):
    num_pages, tokens = 6, 29
    generator = torch.Generator().manual_seed(2)
    memory = torch.randn(num_pages, LAYERS, 2, kv_heads, page_size, head_dim, generator=generator)
    memory = memory.to(dtype).to(device)
    slots = torch.randperm(num_pages * page_size, generator=generator)[:tokens].to(device)
    # k and v as views into one packed projection, the way the runner slices them.
    kv = random_queries((tokens, 2 * kv_heads * head_dim), dtype, device)
    k = kv[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = kv[:, kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    expected = memory.clone()
    reference.write_kv(expected, LAYER, k.contiguous(), v.contiguous(), slots)
    write_kv(memory, LAYER, k, v, slots)
    assert torch.equal(memory, expected)
