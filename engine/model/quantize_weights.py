"""Turn a checkpoint's (or a model's) projection weights into weight-only quantized ones, and count the
bytes a model's weights hold.

The embedding stays dense: a lookup needs rows, not a GEMM; the tied lm_head gets a quantized copy, the
largest GEMV of a decode step. The lm_head is int8 in both modes: the logits are where a small error
flips a greedy choice. Measured on SmolLM2 (float32, "What is the capital of France?"): the top two
first-token logits are 0.08 apart, and an int4 (g32) lm_head, requantized from the file's Q8_0
embedding, picks the second; int8 keeps the first, and GGUF files keep it at 8 bits for that reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import torch

from .config import ModelConfig
from .llama import DecoderLayer, LlamaModel
from .quant import QuantizedWeight, QuantKind, Weight, dequantize, quantize, weight_nbytes

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_checkpoint(
    weights: dict[str, Weight],
    config: ModelConfig,
    kind: QuantKind,
    group_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> dict[str, Weight]:
    """Hugging Face-named weights with every linear projection (and the lm_head, tied or not) quantized
    from its float values; weights that already are `kind` (GGUF Q4_0/Q4_1 as int4) are kept as they
    are. Scales end in `dtype`, codes on `device`."""
    out = dict(weights)
    if config.tie_word_embeddings and "lm_head.weight" not in out:
        out["lm_head.weight"] = weights["model.embed_tokens.weight"]
    for name, w in out.items():
        if not (name.endswith("_proj.weight") or name == "lm_head.weight"):
            continue
        want: QuantKind = "int8" if name == "lm_head.weight" else kind
        if isinstance(w, QuantizedWeight) and w.kind == want:
            q = w
        else:  # a float tensor, or a GGUF Q4 lm_head: requantized from its float values
            dense = dequantize(w, torch.float32) if isinstance(w, QuantizedWeight) else w
            q = quantize(dense, want, group_size, torch.float32)
        out[name] = _placed(q, dtype, device)
    return out


def _placed(w: QuantizedWeight, dtype: torch.dtype, device: torch.device | str) -> QuantizedWeight:
    zeros = None if w.zeros is None else w.zeros.to(device, dtype)
    return QuantizedWeight(
        w.kind,
        w.qweight.to(device),
        w.scales.to(device, dtype),
        zeros,
        w.group_size,
        w.out_features,
        w.in_features,
    )


def quantize_model(model: LlamaModel, kind: QuantKind, group_size: int) -> None:
    """Quantize a dense model's projections in place (random weights: no checkpoint to read from)."""
    for module in model.layers:
        layer = cast(DecoderLayer, module)
        for name in PROJECTIONS:
            dense = getattr(layer, name)
            layer._parameters.pop(name)
            setattr(layer, name, quantize(dense.detach(), kind, group_size))
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    model._parameters.pop("lm_head", None)
    model.lm_head = quantize(head.detach(), "int8")  # type: ignore[assignment]


def quantized_weights(model: LlamaModel) -> Iterator[QuantizedWeight]:
    for module in model.layers:
        for name in PROJECTIONS:
            w = getattr(module, name)
            if isinstance(w, QuantizedWeight):
                yield w
    if isinstance(model.lm_head, QuantizedWeight):
        yield model.lm_head


def weight_bytes(model: LlamaModel) -> int:
    """Bytes the model's weights hold: dense parameters, quantized codes and scales, and the packings and
    dense copies derived from them (quant_plan.py keeps dense copies where dense GEMMs win on the CPU)."""
    dense = sum(weight_nbytes(p) for p in model.parameters())
    return dense + sum(weight_nbytes(w) for w in quantized_weights(model))


def dense_copy_bytes(model: LlamaModel) -> int:
    """Of weight_bytes, the dense copies the CPU keeps for batches past the crossover (none on CUDA):
    weight_bytes less this is what the quantized model needs at least."""
    copies = (w.packed.get("dense") for w in quantized_weights(model))
    return sum(weight_nbytes(t) for t in copies if isinstance(t, torch.Tensor))
