"""The weight-only GEMMs (W8A16, W4A16) against their torch reference: dequantize, then matmul.

Without a GPU they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1). Shapes break
the masks: N = 70 is no multiple of any tile, int8's K = 200 is not either, and M spans the three tile
choices of `_blocks` (1 and 5: the decode tile; 17 and 64: the 64-row tile; 100: the prefill tile, two
row tiles, the second partial). The weights come from E1's quantizers, so the nibble order and the offset
convention are the engine's own.
"""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels import reference
from loraplex.engine.kernels.quant_matmul import _blocks, w4a16_matmul, w8a16_matmul
from loraplex.engine.model.quant import QuantizedWeight, quantize_int4, quantize_int8

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The kernel accumulates in float32 and rounds once; torch's CPU 16-bit matmul rounds differently, so
# 16-bit results agree to about one output ulp (outputs are O(1) here).
TOLERANCES = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
ROWS = [1, 5, 17, 64, 100]


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1


def _x(m: int, k: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _to(w: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    zeros = None if w.zeros is None else w.zeros.to(device)
    return QuantizedWeight(
        w.kind, w.qweight.to(device), w.scales.to(device), zeros, w.group_size, w.out_features, w.in_features
    )


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCES[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROWS)
def test_w8a16_matches_reference(device: torch.device, dtype: torch.dtype, m: int) -> None:
    w = _to(quantize_int8(_weight(70, 200, seed=1), dtype=dtype), device)
    x = _x(m, 200, dtype, device, seed=m)
    _close(w8a16_matmul(x, w), reference.weight_only_matmul(x, w))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("group", [32, 128])
def test_w4a16_matches_reference(device: torch.device, dtype: torch.dtype, m: int, group: int) -> None:
    k = 3 * group  # three groups: a group boundary falls inside a K tile (G 32) or on one (G 128)
    w = _to(quantize_int4(_weight(70, k, seed=2), group_size=group, dtype=dtype), device)
    x = _x(m, k, dtype, device, seed=m)
    _close(w4a16_matmul(x, w), reference.weight_only_matmul(x, w))


def test_w4a16_reads_each_nibble_and_offset(device: torch.device) -> None:
    """Hand-made codes: a swapped nibble order or a dropped offset changes every output."""
    n, k, g = 3, 64, 32
    q = torch.arange(n * k).remainder(16).view(n, k).to(torch.uint8)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    scales = torch.tensor([[1.0, 2.0], [0.5, 1.0], [1.0, 0.25]])
    zeros = torch.tensor([[-8.0, 3.0], [0.0, 1.0], [2.0, -1.0]])
    w = _to(QuantizedWeight("int4", packed, scales, zeros, g, n, k), device)
    x = torch.zeros(2, k)
    x[0, 1] = 1.0  # picks w[:, 1]: odd k, the high nibble of byte 0
    x[1, 40] = 1.0  # picks w[:, 40]: even k in the second group
    expected = torch.stack(
        [q[:, 1].float() * scales[:, 0] + zeros[:, 0], q[:, 40].float() * scales[:, 1] + zeros[:, 1]]
    )
    torch.testing.assert_close(w4a16_matmul(x.to(device), w).cpu(), expected)


def test_leading_dims_and_empty_batch(device: torch.device) -> None:
    w = _to(quantize_int8(_weight(70, 200, seed=3)), device)
    x = _x(6, 200, torch.float32, device, seed=4).view(2, 3, 200)
    _close(w8a16_matmul(x, w), reference.weight_only_matmul(x, w))
    assert w8a16_matmul(x[:0], w).shape == (0, 3, 70)


def test_tiles_by_rows() -> None:
    """Decode batches get the one-row-tile GEMV shape, larger ones taller tiles."""
    assert _blocks(1)[0] == _blocks(16)[0] == 16
    assert _blocks(17)[0] == _blocks(64)[0] == 64
    assert _blocks(65)[:2] == (64, 128)
    assert _blocks(1, "int4")[:4] == (16, 64, 64, 8)  # int4's wider tiles spill in the AOT gate


def test_bad_inputs_are_refused(device: torch.device) -> None:
    w8 = _to(quantize_int8(_weight(8, 32, seed=5)), device)
    w4 = _to(quantize_int4(_weight(8, 32, seed=5), group_size=32), device)
    x = torch.zeros(2, 32, device=device)
    with pytest.raises(ValueError, match="int4 weight"):
        w4a16_matmul(x, w8)
    with pytest.raises(ValueError, match="int8 weight"):
        w8a16_matmul(x, w4)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        w8a16_matmul(x.to(torch.float64), w8)
    with pytest.raises(ValueError, match="31 features"):
        w8a16_matmul(x[:, :31], w8)
