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


@pytest.mark.parametrize("in_background", [True, False])
def test_scales_computed_once_in_the_packer_or_at_the_first_load(in_background: bool) -> None:
    """With host weights the packer computes the scales; otherwise (CUDA weights) the first load does,
    on the engine's thread, into the host copy, which later loads reuse: the pool gets the same rows."""
    from loraplex.engine import EngineConfig, LLMEngine
    from loraplex.engine.kernels import reference
    from tests.engine.test_dora_engine_kernels import SyntheticDora

    loaded = load_model("random:tiny", torch.float32, "cpu", seed=3)
    config = EngineConfig(model="random:tiny", device="cpu", dtype="float32", num_pages=16, page_size=16)
    engine = LLMEngine(config, loaded=loaded)
    engine.loader.scales_in_background = in_background
    base = loaded.config.lora_shape()
    source = SyntheticDora(
        SyntheticAdapter(base, seed=1, rank=4, targets=TARGETS, strength=1.0), loaded.model
    )
    engine.register_adapter("d", source)
    assert engine.warm_adapter("d") == "device"
    packed = engine.loader.host.get("d", lambda: pytest.fail("the host copy is kept"))
    assert packed.dora_pending is None
    resident = engine.loader.resident["d"]
    got = {g: reference.gather_rows(engine.loader.pool_rows, rows) for g, rows in resident.d_rows.items()}
    weights = source.load(torch.float32)
    scales = dora_scales(source.manifest, weights, base, served_base_weights(loaded.model))
    q, kv = base.q_size, base.kv_size
    for layer in range(base.num_layers):
        torch.testing.assert_close(got["qkv"][layer, q : q + kv], scales[(layer, "k")])
        torch.testing.assert_close(got["down"][layer], scales[(layer, "down")])
    assert got["qkv"][:, :q].abs().max() == 0
