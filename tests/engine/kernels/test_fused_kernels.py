"""The fused decode-layer kernels (RMSNorm, residual add + RMSNorm, SiLU·mul, rotary into the KV write)
against their torch references, which are the model's own CPU path.

Run under TRITON_INTERPRET=1 on a machine without a GPU (tests/conftest.py). Each kernel rounds where
torch rounds, so in float32 the results agree to float error and in 16-bit dtypes to one rounding of the
output; the widths are the ones that break masks (576 and 1536 are SmolLM2's, 100 and 37 are odd, 8192
is wider than one warp's share). `rows_each` 1 (or 4) is the GPU's tiling, the default the interpreter's
(all rows in one program); both are checked, with row counts that leave a partial tile.
"""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels import reference
from loraplex.engine.kernels.activation import silu_mul
from loraplex.engine.kernels.gpu import H100, targeting
from loraplex.engine.kernels.rms_norm import add_rms_norm, rms_norm
from loraplex.engine.kernels.row_tiles import rows_per_program
from loraplex.engine.kernels.write_kv import rotary_write_kv
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.rope import cos_sin_table

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # ~one 16-bit ulp


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCES[expected.dtype]
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int, scale: float = 1.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows, hidden, rows_each", [(1, 576, None), (5, 100, None), (3, 8192, 1), (5, 100, 2)]
)
def test_rms_norm_matches_the_reference(
    rows: int, hidden: int, rows_each: int | None, dtype: torch.dtype, device: torch.device
) -> None:
    x = randn(rows, hidden, dtype=dtype, device=device, seed=0, scale=3.0)
    weight = randn(hidden, dtype=dtype, device=device, seed=1)
    close(rms_norm(x, weight, 1e-5, rows_each), reference.rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden, rows_each", [(1, 576, None), (7, 100, None), (7, 100, 1)])
def test_add_rms_norm_returns_the_sum_and_its_norm(
    rows: int, hidden: int, rows_each: int | None, dtype: torch.dtype, device: torch.device
) -> None:
    hidden_in = randn(rows, hidden, dtype=dtype, device=device, seed=2, scale=4.0)
    delta = randn(rows, hidden, dtype=dtype, device=device, seed=3)
    weight = randn(hidden, dtype=dtype, device=device, seed=4)
    before = hidden_in.clone()
    total, normed = add_rms_norm(hidden_in, delta, weight, 1e-6, rows_each)
    expected_total, expected_normed = reference.add_rms_norm(hidden_in, delta, weight, 1e-6)
    # The add rounds once, as torch's does (bitwise equal natively and in float16/32; the interpreter
    # truncates float32 to bfloat16 where a GPU rounds to nearest, a difference of one ulp).
    close(total, expected_total)
    if dtype != torch.bfloat16:
        assert torch.equal(total, expected_total)
    close(normed, expected_normed)
    assert torch.equal(hidden_in, before)  # the residual input is not overwritten


def test_rms_norm_reads_strided_rows_and_handles_no_rows(device: torch.device) -> None:
    wide = randn(4, 2 * 96, dtype=torch.float32, device=device, seed=5)
    x = wide[:, :96]  # rows 192 apart
    weight = randn(96, dtype=torch.float32, device=device, seed=6)
    close(rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
    assert rms_norm(x[:0], weight, 1e-5).shape == (0, 96)


def test_rms_norm_refuses_a_weight_of_another_width(device: torch.device) -> None:
    x = torch.ones(2, 8, device=device)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, torch.ones(9, device=device), 1e-5)
    with pytest.raises(ValueError, match="delta"):
        add_rms_norm(x, torch.ones(2, 9, device=device), torch.ones(8, device=device), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, intermediate, rows_each", [(1, 1536, None), (6, 37, None), (3, 1536, 1)])
def test_silu_mul_matches_the_reference(
    rows: int, intermediate: int, rows_each: int | None, dtype: torch.dtype, device: torch.device
) -> None:
    gate_up = randn(rows, 2 * intermediate, dtype=dtype, device=device, seed=7, scale=4.0)
    close(silu_mul(gate_up, rows_each), reference.silu_mul(gate_up))


def test_silu_mul_refuses_an_odd_width(device: torch.device) -> None:
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        silu_mul(torch.ones(2, 7, device=device))


def qkv_and_rope(
    tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused [T, (heads + 2 kv_heads) * dim] projection output (q, k, v are strided views of it, as in
    the model) and the cos/sin rows [T, 1, dim] of shuffled positions from the model's own table."""
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, device=device, seed=8)
    config = ModelConfig(
        hidden_size=heads * dim, intermediate_size=8, num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
        vocab_size=8, rope_theta=500000.0,
    )  # fmt: skip
    cos_table, sin_table = cos_sin_table(config, 4096, dtype, device)
    positions = torch.randperm(4096, generator=torch.Generator().manual_seed(9))[:tokens].to(device)
    return qkv, cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)


def split(qkv: torch.Tensor, heads: int, kv_heads: int, dim: int):
    tokens = qkv.shape[0]
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    return qk[:, :heads], qk[:, heads:], v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tokens, heads, kv_heads, dim, page_size, rows_each",
    [(5, 9, 3, 64, 16, None), (3, 4, 4, 128, 8, None), (1, 8, 1, 96, 16, None), (5, 9, 3, 64, 16, 4)],
    ids=["smollm2", "mha-d128", "gqa8-d96", "smollm2-gpu-tiles"],
)
def test_rotary_write_kv_rotates_q_k_and_stores_k_v(
    tokens: int,
    heads: int,
    kv_heads: int,
    dim: int,
    page_size: int,
    rows_each: int | None,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    qkv, cos, sin = qkv_and_rope(tokens, heads, kv_heads, dim, dtype, device)
    layers, layer, pages = 3, 1, 4
    memory = randn(pages, layers, 2, kv_heads, page_size, dim, dtype=dtype, device=device, seed=10)
    # Shuffled slots on pages 1-3, so a wrong page or offset lands somewhere checked.
    slots = torch.randperm((pages - 1) * page_size, generator=torch.Generator().manual_seed(11))[:tokens]
    slots = (slots + page_size).to(device)
    expected_qkv, expected_memory = qkv.clone(), memory.clone()
    reference.rotary_write_kv(
        expected_memory, layer, *split(expected_qkv, heads, kv_heads, dim), slots, cos, sin
    )
    rotary_write_kv(memory, layer, *split(qkv, heads, kv_heads, dim), slots, cos, sin, rows_each)
    close(qkv, expected_qkv)  # q and k rotated in place, v untouched
    close(memory, expected_memory)  # keys rotated into their slots, values beside them, nothing else
    assert not torch.equal(qkv, randn(*qkv.shape, dtype=dtype, device=device, seed=8))


def test_rotary_write_kv_with_no_tokens_changes_nothing(device: torch.device) -> None:
    qkv, cos, sin = qkv_and_rope(0, 2, 1, 8, torch.float32, device)
    memory = torch.zeros(2, 1, 2, 1, 4, 8, device=device)
    rotary_write_kv(
        memory, 0, *split(qkv, 2, 1, 8), torch.zeros(0, dtype=torch.int64, device=device), cos, sin
    )
    assert not memory.any()


def test_rows_per_program_is_the_gpus_when_recording_for_a_gpu() -> None:
    # The ahead-of-time gate and the warm-up record on `meta` inside `targeting`: they must see the
    # GPU's one-row tiles, not the interpreter's wide ones.
    meta = torch.device("meta")
    with targeting(H100):
        assert rows_per_program(meta, 100, 576) == 1
        assert rows_per_program(meta, 100, 64, gpu_rows=4) == 4
    assert rows_per_program(torch.device("cpu"), 100, 576) == 64  # 64k elements: 64 rows of 1024
    assert rows_per_program(torch.device("cpu"), 3, 576) == 4
