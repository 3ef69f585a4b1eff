"""DoRA's scale at load (engine/lora/dora.py, layout.py): g - 1 = m / ||W0 + s·B·A|| - 1 per output
channel against the base weights served (dequantized when quantized), packed beside A and B in rows
count_rows foresees, zero in the columns of modules an adapter does not adapt; a biased q/k/v refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraplex.adapters import AdapterError
from loraplex.engine.lora.dora import dora_scales, served_base_weights
from loraplex.engine.lora.layout import count_rows, dora_groups, pack_adapter
from loraplex.engine.lora.sources import DoraWeights
from loraplex.engine.lora.synthetic import SyntheticAdapter
from loraplex.engine.model.config import NAMED_SHAPES
from loraplex.engine.model.llama import LlamaModel
from loraplex.engine.model.loader import load_model
from loraplex.engine.model.quant import QuantizedWeight, dequantize

TARGETS = ("k", "gate", "down")  # one of qkv, one of gate_up, down: columns left at 0 in fused groups


def dora_adapter(model: torch.nn.Module, base, seed: int = 1):  # type: ignore[no-untyped-def]
    lora = SyntheticAdapter(base, seed=seed, rank=4, targets=TARGETS, alpha=8.0, strength=1.0)
    manifest = lora.manifest
    manifest = dataclasses.replace(
        manifest,
        config=dataclasses.replace(manifest.config, use_dora=True),
        modules=tuple(dataclasses.replace(m, dora=True) for m in manifest.modules),
    )
    weights = lora.load(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    magnitudes = {key: 1 + torch.rand(b.shape[0], generator=generator) for key, (_, b) in weights.items()}
    return manifest, DoraWeights(weights, magnitudes)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_scales_are_m_over_the_norm_against_the_served_weights(quantization: str) -> None:
    loaded = load_model("random:tiny", torch.float32, "cpu", seed=3, quantization=quantization)
    base = loaded.config.lora_shape()
    manifest, weights = dora_adapter(loaded.model, base)
    scales = dora_scales(manifest, weights, base, served_base_weights(loaded.model))
    assert set(scales) == set(weights)
    layer = loaded.model.layers[1]
    fused = layer.qkv_proj
    if quantization == "int8":
        assert isinstance(fused, QuantizedWeight)
        dense = dequantize(fused, torch.float32)
    else:
        dense = fused.float()
    q, kv = base.q_size, base.kv_size
    w0 = dense[q : q + kv]  # k
    a, b = weights[(1, "k")]
    scale = manifest.modules[0].scale
    assert scale == 2.0
    want = weights.magnitudes[(1, "k")] / torch.linalg.vector_norm(w0 + scale * (b @ a), dim=1) - 1
    torch.testing.assert_close(scales[(1, "k")], want, rtol=1e-6, atol=1e-7)

    # packed: one row of the group's width per layer and group, k's block holding h, q and v zero
    head_dim = loaded.config.head_dim
    rows_per_page = 64
    packed = pack_adapter(manifest, weights, base, head_dim, rows_per_page, scales)
    assert packed.num_rows == count_rows(manifest, head_dim, rows_per_page, base)
    assert len(dora_groups(manifest)) == base.num_layers * 3
    assert set(packed.d_rows) == {"qkv", "gate_up", "down"}
    virtual = torch.zeros(packed.num_rows, head_dim)
    virtual[packed.data_rows] = packed.data.float()
    row = virtual[packed.d_rows["qkv"][1]].flatten()
    assert torch.equal(row[:q], torch.zeros(q)) and torch.equal(row[q + kv :], torch.zeros(kv))
    torch.testing.assert_close(row[q : q + kv], scales[(1, "k")])


def test_dora_on_a_biased_qkv_is_refused_by_name() -> None:
    config = dataclasses.replace(NAMED_SHAPES["tiny"], attention_bias=True)
    model = LlamaModel(config)
    weights = served_base_weights(model)
    with pytest.raises(AdapterError, match="use_dora: DoRA on projections with a bias"):
        weights(0, "qkv")
    assert weights(0, "o").shape == (config.hidden_size, config.q_size)
