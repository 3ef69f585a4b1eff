"""Weight-only quantized base weights: one canonical format, quantizers, and the `linear()` dispatch.

The canonical format (`QuantizedWeight`) is what every device path reads; device-specific packings (torch's
CPU int4 tile layout) are derived from it once and cached on the object, never stored instead of it.

int8 (per output channel, symmetric)::

    qweight  int8  [N, K]
    scales   [N]              (activation dtype)
    zeros    None
    w[n, k] = scales[n] * qweight[n, k]

int4 (group-wise, asymmetric; group size G divides K)::

    qweight  uint8 [N, K // 2]   two 4-bit codes per byte: q[n, 2j] in the LOW nibble of qweight[n, j],
                                 q[n, 2j + 1] in the HIGH nibble (codes 0..15, unsigned)
    scales   [N, K // G]          (activation dtype)
    zeros    [N, K // G]          (activation dtype): an additive offset, not an integer zero point
    w[n, k] = scales[n, k // G] * q[n, k] + zeros[n, k // G]

GGUF maps onto it directly: Q4_1 is d * q + m (scales = d, zeros = m), Q4_0 is d * (q - 8)
(scales = d, zeros = -8 d); both have G = 32.

**Semantics:** `linear(x, w, bias) == x @ dequantize(w, x.dtype).T + bias`, up to the accumulation
order of the kernel that runs it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from .quant_formats import DEFAULT_INT4_GROUP_SIZE, INT4_GROUP_SIZES, QUANTIZATIONS

QuantKind = Literal["int8", "int4"]
__all__ = ["INT4_GROUP_SIZES", "QUANTIZATIONS", "QuantizedWeight", "dequantize", "linear", "quantize"]


@dataclass(eq=False)
class QuantizedWeight:
    """A [out_features, in_features] weight stored as int8 or int4 codes with scales (see module doc)."""

    kind: QuantKind
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    out_features: int
    in_features: int
    # Device-specific packings derived at load ("cpu_int4" -> torch's tile layout, ...): a cache, not state.
    packed: dict[str, object] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        n, k = self.out_features, self.in_features
        if self.kind == "int8":
            _check(self.qweight, torch.int8, (n, k), "int8 qweight")
            _check(self.scales, None, (n,), "int8 scales")
            if self.zeros is not None:
                raise ValueError("int8 weights are symmetric: zeros must be None")
            if self.group_size != k:
                raise ValueError(f"int8 weights are per channel: group_size must be in_features ({k})")
        elif self.kind == "int4":
            g = self.group_size
            if g <= 0 or k % g or g % 2:
                raise ValueError(f"int4 group_size {g} must be even and divide in_features {k}")
            _check(self.qweight, torch.uint8, (n, k // 2), "int4 qweight")
            _check(self.scales, None, (n, k // g), "int4 scales")
            if self.zeros is None:
                raise ValueError("int4 weights need zeros (the per-group offset)")
            _check(self.zeros, self.scales.dtype, (n, k // g), "int4 zeros")
        else:
            raise ValueError(f"unknown quantization kind {self.kind!r}; expected int8 or int4")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype the scales are stored in (what dequantize returns by default)."""
        return self.scales.dtype

    def nbytes(self) -> int:
        """Bytes of the canonical tensors (codes, scales, zeros); derived packings are not counted."""
        tensors = [self.qweight, self.scales] + ([self.zeros] if self.zeros is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def _check(t: torch.Tensor, dtype: torch.dtype | None, shape: tuple[int, ...], what: str) -> None:
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{what} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{what} must have shape {shape}, got {tuple(t.shape)}")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] in 0..15 (any integer dtype) -> uint8 [N, K // 2], even k in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] -> uint8 codes [N, K] (the inverse of pack_int4)."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)


def dequantize(w: QuantizedWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense [N, K] weight the codes stand for, computed in float32 and cast to `dtype`."""
    dtype = dtype or w.dtype
    if w.kind == "int8":
        dense = w.qweight.float() * w.scales.float()[:, None]
    else:
        assert w.zeros is not None
        q = unpack_int4(w.qweight).float().view(w.out_features, -1, w.group_size)  # [N, K/G, G]
        dense = q * w.scales.float()[..., None] + w.zeros.float()[..., None]
        dense = dense.view(w.out_features, w.in_features)
    return dense.to(dtype)


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype | None = None) -> QuantizedWeight:
    """Symmetric per-output-channel int8: scale = max|w| / 127 per row, codes in -127..127."""
    dtype = dtype or weight.dtype
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(dtype)  # [N]
    q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    n, k = weight.shape
    return QuantizedWeight("int8", q, scales, None, k, n, k)


def quantize_int4(
    weight: torch.Tensor, group_size: int = DEFAULT_INT4_GROUP_SIZE, dtype: torch.dtype | None = None
) -> QuantizedWeight:
    """Asymmetric group-wise int4 (min/max per group): scale = (max - min) / 15, zeros = min."""
    dtype = dtype or weight.dtype
    n, k = weight.shape
    if k % group_size:
        raise ValueError(
            f"int4 group size {group_size} does not divide in_features {k}: "
            "use a quantization whose group size does (int4 groups 32 weights, int4-g128 groups 128)"
        )
    w = weight.float().view(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [N, K/G]
    scales = ((hi - lo) / 15.0).clamp_min(1e-12).to(dtype)
    zeros = lo.to(dtype)
    # Codes against the stored (rounded) scales and zeros, so dequantize sees what rounding chose.
    q = torch.round((w - zeros.float()[..., None]) / scales.float()[..., None]).clamp_(0, 15)
    return QuantizedWeight("int4", pack_int4(q.view(n, k)), scales, zeros, group_size, n, k)


def quantize(
    weight: torch.Tensor,
    kind: QuantKind,
    group_size: int = DEFAULT_INT4_GROUP_SIZE,
    dtype: torch.dtype | None = None,
) -> QuantizedWeight:
    if kind == "int8":
        return quantize_int8(weight, dtype)
    if kind == "int4":
        return quantize_int4(weight, group_size, dtype)
    raise ValueError(f"unknown quantization {kind!r}; expected int8 or int4")


def with_dtype(w: QuantizedWeight, dtype: torch.dtype) -> QuantizedWeight:
    """The same codes with scales (and zeros) stored in `dtype`, the activation dtype the kernels take."""
    if w.scales.dtype == dtype:
        return w
    zeros = None if w.zeros is None else w.zeros.to(dtype)
    return QuantizedWeight(
        w.kind, w.qweight, w.scales.to(dtype), zeros, w.group_size, w.out_features, w.in_features
    )


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights along out_features (q, k, v into qkv): codes and scales are per row, so rows concat."""
    first = parts[0]
    for p in parts[1:]:
        same = (p.kind, p.group_size, p.in_features, p.scales.dtype)
        if same != (first.kind, first.group_size, first.in_features, first.scales.dtype):
            raise ValueError(
                f"cannot fuse {p.kind}/g{p.group_size} with {first.kind}/g{first.group_size} weights: "
                "quantize the fused projections alike"
            )
    zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts if p.zeros is not None])
    return QuantizedWeight(
        first.kind,
        torch.cat([p.qweight for p in parts]),
        torch.cat([p.scales for p in parts]),
        zeros,
        first.group_size,
        sum(p.out_features for p in parts),
        first.in_features,
    )


def select_rows(w: QuantizedWeight, index: torch.Tensor) -> QuantizedWeight:
    """Rows `index` of `w` (GGUF's q/k row permutation applies to codes and scales alike)."""
    zeros = None if w.zeros is None else w.zeros[index]
    return QuantizedWeight(
        w.kind, w.qweight[index], w.scales[index], zeros, w.group_size, len(index), w.in_features
    )


Weight = torch.Tensor | QuantizedWeight


def weight_nbytes(w: Weight) -> int:
    """Resident bytes of a weight: a dense tensor, or quantized codes + scales + the packings derived."""
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    derived = [t for t in w.packed.values() if isinstance(t, torch.Tensor)]
    return w.nbytes() + sum(t.numel() * t.element_size() for t in derived)


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` for a dense or a weight-only quantized base weight ([T, K] -> [T, N])."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    y = _quantized_matmul(x.reshape(-1, w.in_features), w).view(*x.shape[:-1], w.out_features)
    return y if bias is None else y + bias


def _quantized_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    if x.device.type == "cpu":
        limit = w.packed.get("cpu_max_quant_tokens")
        if isinstance(limit, int) and x.shape[0] > limit:
            # Past the measured crossover a dense bf16/f32 GEMM beats torch's weight-only kernels.
            dense = w.packed.get("dense")
            if isinstance(dense, torch.Tensor) and dense.dtype == x.dtype:
                return F.linear(x, dense)
            return F.linear(x, dequantize(w, x.dtype))
        return cpu_weight_only_matmul(x, w)
    if x.device.type == "cuda":
        kernel = _cuda_kernel(w.kind)
        if kernel is not None:
            return kernel(x, w)
    return F.linear(x, dequantize(w, x.dtype))  # correct everywhere, fast nowhere


def _cuda_kernel(kind: QuantKind) -> Any:
    """Helper E2's Triton W8A16/W4A16 GEMMs, or None where they are not importable (no Triton)."""
    try:  # imported by name: the kernels module is optional (it needs Triton)
        quant_matmul = importlib.import_module("loraplex.engine.kernels.quant_matmul")
    except ImportError:
        return None
    return getattr(quant_matmul, "w8a16_matmul" if kind == "int8" else "w4a16_matmul", None)


def cpu_weight_only_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """torch's CPU weight-only kernels: int8 per channel, int4 in its own tile packing (cached on `w`)."""
    x = x.contiguous()
    if w.kind == "int8":
        return torch.ops.aten._weight_int8pack_mm(x, w.qweight, _cached_scales(w, x.dtype))
    packed, scales_and_zeros = cpu_int4_packing(w, x.dtype)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, w.group_size, scales_and_zeros)


def _cached_scales(w: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    if w.scales.dtype == dtype:
        return w.scales
    key = f"scales_{dtype}"
    cached = w.packed.get(key)
    if not isinstance(cached, torch.Tensor):
        cached = w.packed[key] = w.scales.to(dtype)
    return cached


def cpu_int4_packing(w: QuantizedWeight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, scales_and_zeros [K/G, N, 2]) for `_weight_int4pack_mm_for_cpu`, made once.

    torch's CPU int4 op computes w = scale * (q - 8) + zero, so its zero is our offset + 8 * scale.
    """
    key = f"cpu_int4_{dtype}"
    cached = w.packed.get(key)
    if isinstance(cached, tuple):
        return cached
    assert w.zeros is not None
    codes = unpack_int4(w.qweight).to(torch.int32)  # [N, K]
    packed = w.packed.get("cpu_int4_codes")
    if not isinstance(packed, torch.Tensor):
        packed = w.packed["cpu_int4_codes"] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales = w.scales.float()
    torch_zeros = w.zeros.float() + 8 * scales
    scales_and_zeros = torch.stack((scales, torch_zeros), dim=-1).transpose(0, 1).contiguous().to(dtype)
    w.packed[key] = (packed, scales_and_zeros)
    return packed, scales_and_zeros
