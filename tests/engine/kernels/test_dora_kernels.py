"""The DoRA scale kernels (engine/kernels/lora_dora.py) against their plain-torch references, and the
references against a naive per-row computation: rows of DoRA adapters are multiplied by 1 + h, every
other row (no adapter, a plain LoRA adapter, an adapter of rank 0 in the group, a layer without a scale
row) is left bit for bit. Without a GPU the kernels run in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels import lora_dora, reference
from loraplex.engine.kernels.lora_meta import LoRAKernelMeta

HEAD_DIM = 64
OUT = 960  # SmolLM2-135M's qkv: 576 | 192 | 192
LAYERS = 2
# slot -> (rank in this group, DoRA): a DoRA adapter, a plain one, a DoRA adapter that does not adapt
# the group (rank 0: its slot_start is 0, the first DoRA adapter's column), another DoRA adapter
SLOTS = ((8, True), (4, False), (0, True), (16, True))


def make_meta(
    dtype: torch.dtype, device: torch.device, **rows: torch.Tensor | None
) -> tuple[torch.Tensor, LoRAKernelMeta]:
    """(pool rows, meta): each DoRA slot's g - 1 rows for layer 0 somewhere in a pool of garbage; layer
    1 has a scale row for slot 0 only."""
    generator = torch.Generator().manual_seed(0)
    per_row = OUT // HEAD_DIM
    pool = torch.randn(4 + 8 * per_row, HEAD_DIM, generator=generator) * 0.3
    pool[:per_row] = 0  # the zero page
    starts, ranks, column = [], [], 0
    d_starts = torch.zeros(LAYERS, sum(r for r, _ in SLOTS), dtype=torch.long)
    cursor = per_row + 1
    for rank, dora in SLOTS:
        starts.append(column if rank else 0)
        ranks.append(rank)
        if rank and dora:
            d_starts[0, column] = cursor
            cursor += per_row + 2
        column += rank
    d_starts[1, 0] = cursor
    empty = torch.zeros(LAYERS, d_starts.shape[1], dtype=torch.long)
    meta = LoRAKernelMeta(
        empty.to(device),
        empty.to(device),
        empty.int().to(device),
        empty.int().to(device),
        torch.tensor(starts, dtype=torch.int32, device=device),
        torch.tensor(ranks, dtype=torch.int32, device=device),
        d_starts=d_starts.to(device),
        **rows,  # type: ignore[arg-type]
    )
    return pool.to(device, dtype), meta


def naive(
    y: torch.Tensor, pool: torch.Tensor, meta: LoRAKernelMeta, layer: int, token_slot: list[int]
) -> torch.Tensor:
    assert meta.d_starts is not None
    out = y.clone()
    for t, slot in enumerate(token_slot):
        if slot < 0 or int(meta.slot_rank[slot]) == 0:
            continue
        d = int(meta.d_starts[layer, int(meta.slot_start[slot])])
        if d:
            h = pool[d : d + OUT // HEAD_DIM].reshape(-1).float()
            out[t] = (y[t].float() * (1 + h)).to(y.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", [0, 1])
def test_tokens_scale_dora_rows_only(device: torch.device, dtype: torch.dtype, layer: int) -> None:
    token_slot = [0, -1, 1, 2, 3, 0, 3, -1, 1]
    slots = torch.tensor(token_slot, dtype=torch.int32, device=device)
    pool, meta = make_meta(dtype, device, token_slot=slots)
    y = torch.randn(len(token_slot), OUT, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    want = naive(y.cpu(), pool.cpu(), _cpu(meta), layer, token_slot)
    ref = y.clone()
    reference.lora_dora_scale_tokens(ref, pool, meta, layer)
    got = y.clone()
    lora_dora.lora_dora_scale_tokens(got, pool, meta, layer)
    torch.testing.assert_close(ref.cpu(), want, rtol=0, atol=0)
    torch.testing.assert_close(got.cpu(), want, **tolerance(dtype))
    untouched = [t for t, s in enumerate(token_slot) if s in (-1, 1, 2) or (layer == 1 and s != 0)]
    assert torch.equal(got[untouched], y[untouched])
    assert not torch.equal(got, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segments_scale_dora_rows_only(device: torch.device, dtype: torch.dtype) -> None:
    # segments: 3 rows of slot 0, an empty one, 20 rows of slot 3 (two 16-row blocks), 2 of none, 5 of slot 1
    lengths, seg_slot = [3, 0, 20, 2, 5, 4], [0, 3, 3, -1, 1, 2]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    token_slot = [s for n, s in zip(lengths, seg_slot, strict=True) for _ in range(n)]
    pool, meta = make_meta(
        dtype,
        device,
        seg_starts=torch.tensor(starts, dtype=torch.int32, device=device),
        seg_slot=torch.tensor(seg_slot, dtype=torch.int32, device=device),
    )
    y = torch.randn(starts[-1], OUT, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    want = naive(y.cpu(), pool.cpu(), _cpu(meta), 0, token_slot)
    ref = y.clone()
    reference.lora_dora_scale_segments(ref, pool, meta, 0)
    got = y.clone()
    lora_dora.lora_dora_scale_segments(got, pool, meta, 0)
    torch.testing.assert_close(ref.cpu(), want, rtol=0, atol=0)
    torch.testing.assert_close(got.cpu(), want, **tolerance(dtype))
    assert not torch.equal(got, y)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Exact in float32; in 16 bits one rounding step (the interpreter rounds toward zero)."""
    return {"rtol": 0.0, "atol": 0.0} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 0.0}


def _cpu(meta: LoRAKernelMeta) -> LoRAKernelMeta:
    assert meta.d_starts is not None
    return LoRAKernelMeta(
        meta.a_starts.cpu(),
        meta.b_starts.cpu(),
        meta.b_cols.cpu(),
        meta.b_widths.cpu(),
        meta.slot_start.cpu(),
        meta.slot_rank.cpu(),
        d_starts=meta.d_starts.cpu(),
    )


def test_the_reference_makes_no_tensor_on_another_device() -> None:
    """On the meta device, any tensor the reference makes off its inputs' device fails the op: what broke
    both references on CUDA (a CPU arange beside the step's rows; H200, 2026-11-28). The tokens form runs
    the body both share; the segments form reads its longest segment on the host, which meta cannot."""
    meta_device = torch.device("meta")
    slots = torch.tensor([0, -1, 1, 3], dtype=torch.int32, device=meta_device)
    pool, meta = make_meta(torch.float32, meta_device, token_slot=slots)
    reference.lora_dora_scale_tokens(torch.empty(4, OUT, device=meta_device), pool, meta, 0)
