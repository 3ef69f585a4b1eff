"""DoRA: the per-output-channel scale of a DoRA adapter, derived once when it is loaded.

PEFT's DoRA layer (peft/tuners/lora/dora.py) computes, for a base projection W0 [out, in] without its
bias, LoRA scale s and magnitude vector m [out]:

    g = m / ||W0 + s·B·A||   (the L2 norm over the input dim, one value per output channel, detached)
    y = W0·x + (g - 1)·(W0·x) + g·s·B·A·x  =  g ⊙ (W0·x + s·B·A·x)

g depends only on weights, so the engine computes it here, in float32, against the base weights it
actually serves (a quantized projection's dequantized values), and the pool keeps h = g - 1 beside the
adapter's A and B (layout.py). A step then applies each row's adapter delta as for plain LoRA and
multiplies the rows of DoRA adapters by 1 + h (the CPU stacker in lora/step.py, the Triton path in
kernels/lora_dora.py); rows of plain adapters and base rows are not touched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from loraplex.adapters import AdapterError, AdapterManifest, BaseShape

from .layout import GROUPS
from .sources import LoraWeights, magnitudes_of

# (layer, group) -> the group's fused base weight [group out, in] in float32, as served (dequantized);
# raises AdapterError where DoRA cannot be served (a projection with a bias).
BaseWeights = Callable[[int, str], torch.Tensor]

_GROUP_OF = {module: group for group, modules in GROUPS.items() for module in modules}


def dora_scales(
    manifest: AdapterManifest, weights: LoraWeights, base: BaseShape, base_weights: BaseWeights
) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, module) -> h = g - 1 [out] float32 on the CPU, for every module of a DoRA adapter."""
    magnitudes = magnitudes_of(weights)
    scales: dict[tuple[int, str], torch.Tensor] = {}
    fused: dict[tuple[int, str], torch.Tensor] = {}
    for lora in manifest.modules:
        key = (lora.layer, lora.module)
        group = _GROUP_OF[lora.module]
        if (lora.layer, group) not in fused:
            fused = {(lora.layer, group): base_weights(lora.layer, group)}  # one group's weight at a time
        dense = fused[(lora.layer, group)]
        column = 0
        for module in GROUPS[group]:
            if module == lora.module:
                break
            column += base.features(module)[1]
        w0 = dense[column : column + lora.out_features]
        a, b = (t.to(w0.device, torch.float32) for t in weights[key])
        norm = torch.linalg.vector_norm(w0 + lora.scale * (b @ a), dim=1)
        g = magnitudes[key].to(w0.device, torch.float32) / norm
        h = (g - 1).cpu()
        if not bool(torch.isfinite(h).all()):
            raise AdapterError(
                f"layer {lora.layer} {lora.module}: the DoRA scale m / ||W0 + s·B·A|| is not finite "
                "(a zero-norm output channel): refusing the adapter"
            )
        scales[key] = h
    return scales


def served_base_weights(model: torch.nn.Module) -> BaseWeights:
    """The BaseWeights of a loaded LlamaModel (engine/model/llama.py): its fused projections in float32,
    dequantized where they are quantized."""
    from ..model.llama import DecoderLayer
    from ..model.quant import QuantizedWeight, dequantize

    layers = cast(torch.nn.ModuleList, model.layers)

    def weight(layer: int, group: str) -> torch.Tensor:
        decoder = cast(DecoderLayer, layers[layer])
        if group == "qkv" and decoder.qkv_bias is not None:
            raise AdapterError(
                "use_dora: DoRA on projections with a bias (this base model's q, k and v) is not supported"
            )
        param = getattr(decoder, f"{group}_proj")
        if isinstance(param, QuantizedWeight):
            return dequantize(param, torch.float32)
        return param.detach().float()

    return weight
