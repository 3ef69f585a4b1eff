"""bench/gguf_lora.py: the llama.cpp LoRA adapter file, read back with gguf's reader (no llama.cpp needed),
and its q/k rows checked against our own GGUF loader's q/k handling on SmolLM2's real file."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from loraplex.bench import gguf_lora
from loraplex.bench.quant import DEMO_ADAPTER_DIR
from loraplex.engine.model.gguf_loader import _unpermute
from loraplex.engine.model.loader import default_model_path

MODULES = ("q", "k", "v", "o", "gate", "up", "down")


@pytest.fixture(scope="module")
def base() -> gguf_lora.BaseGGUF:
    return gguf_lora.BaseGGUF(default_model_path())


@pytest.fixture(scope="module")
def demo(base: gguf_lora.BaseGGUF) -> Any:
    return gguf_lora.open_peft(DEMO_ADAPTER_DIR, base)


# Writing and reading back the demo's file takes seconds (gguf's writer and reader are plain Python): each
# file is made once per module.
@pytest.fixture(scope="module")
def written(base: gguf_lora.BaseGGUF, demo: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(metadata, tensors) of the demo adapter's file."""
    return read_back(gguf_lora.write_lora_gguf(demo, base, tmp_path_factory.mktemp("gguf") / "demo.gguf"))


@pytest.fixture(scope="module")
def written_unpermuted(
    base: gguf_lora.BaseGGUF, demo: Any, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, np.ndarray]:
    """The tensors of the demo's file written with the q/k row permutation left out: what a writer that
    dropped it would give."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_lora, "permute_rows", lambda weight, heads: weight)
        path = gguf_lora.write_lora_gguf(demo, base, tmp_path_factory.mktemp("gguf") / "unpermuted.gguf")
    return read_back(path)[1]


def read_back(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(metadata, tensors as numpy [slowest first]) of a written file."""
    from gguf import GGUFReader

    from loraplex.engine.model.gguf_loader import read_metadata

    reader = GGUFReader(str(path))
    tensors = {
        t.name: np.asarray(t.data, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        for t in reader.tensors
    }
    return read_metadata(reader), tensors


def test_permute_rows_interleaves_each_heads_rotary_halves() -> None:
    rows = np.arange(8)[:, None] * np.ones((1, 3))
    # Two heads of 4 rows: per head [0 1 | 2 3] -> 0 2 1 3 (llama.cpp's LlamaModel.permute).
    assert gguf_lora.permute_rows(rows, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    with pytest.raises(ValueError):
        gguf_lora.permute_rows(np.zeros((6, 2)), 2)


def test_demo_adapter_file_has_llama_cpps_names_shapes_and_alpha(
    base: gguf_lora.BaseGGUF, demo: Any, written: Any
) -> None:
    metadata, tensors = written
    assert metadata["general.architecture"] == "llama"
    assert metadata["general.type"] == "adapter"
    assert metadata["adapter.type"] == "lora"
    assert metadata["adapter.lora.alpha"] == pytest.approx(16.0)  # the demo's lora_alpha; r = 8
    config = base.config
    expected = {}
    for layer in range(config.num_layers):
        for module in MODULES:
            in_features, out_features = base.shape.features(module)
            name = f"blk.{layer}.{gguf_lora.GGUF_TENSORS[module]}.weight"
            expected[f"{name}.lora_a"] = (8, in_features)
            expected[f"{name}.lora_b"] = (out_features, 8)
    assert {n: t.shape for n, t in tensors.items()} == expected
    # Every name is a base tensor's name plus .lora_a / .lora_b (llama.cpp refuses any other).
    base_names = {t.name for t in base.header.tensors}
    assert {n.rsplit(".", 1)[0] for n in tensors} <= base_names
    # A is written as PEFT has it; v's B (never permuted) too.
    weights = demo.load(torch.float32)
    a, b = (t.numpy() for t in weights[(3, "v")])
    np.testing.assert_array_equal(tensors["blk.3.attn_v.weight.lora_a"], a)
    np.testing.assert_array_equal(tensors["blk.3.attn_v.weight.lora_b"], b)


def adapted_as_our_loader_reads_it(
    tensors: dict[str, np.ndarray], alpha: float, base_q_or_k: np.ndarray, name: str, heads: int
) -> np.ndarray:
    """What llama.cpp computes with the written file, W_file + alpha / r * B_file A_file, taken through our
    loader's un-permutation (engine/model/gguf_loader.py) back to Hugging Face row order."""
    a, b = tensors[f"{name}.lora_a"], tensors[f"{name}.lora_b"]
    merged = base_q_or_k + alpha / a.shape[0] * (b @ a)
    return _unpermute(merged, heads)


@pytest.mark.parametrize("module", ["q", "k"])
def test_q_and_k_through_the_files_permutation_equal_our_loaders_weight_plus_the_delta(
    base: gguf_lora.BaseGGUF, demo: Any, module: str, written: Any, written_unpermuted: dict[str, np.ndarray]
) -> None:
    from gguf.quants import dequantize

    from loraplex.engine.model.gguf_loader import _tensor_data

    layer = 5
    name = f"blk.{layer}.{gguf_lora.GGUF_TENSORS[module]}.weight"
    tensor = next(t for t in base.header.tensors if t.name == name)
    # The base weight as llama.cpp's converter stored it (its rows permuted): what llama.cpp adds to.
    stored = dequantize(_tensor_data(base.data, tensor), tensor.ggml_type).reshape(tensor.shape)
    stored = np.asarray(stored, dtype=np.float32)
    heads = {"q": base.config.num_heads, "k": base.config.num_kv_heads}[module]
    assert base.heads(module) == heads
    # Ours: the loader's float weight plus the PEFT delta (scale alpha / r = 2) in Hugging Face order.
    a, b = (t.numpy() for t in demo.load(torch.float32)[(layer, module)])
    expected = _unpermute(stored, heads) + 2.0 * (b @ a)

    got = adapted_as_our_loader_reads_it(written[1], 16.0, stored, name, heads)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)

    # Without the permutation the same check fails: the test sees a dropped or wrong reorder.
    wrong = adapted_as_our_loader_reads_it(written_unpermuted, 16.0, stored, name, heads)
    assert not np.allclose(wrong, expected, rtol=1e-5, atol=1e-5)


def test_synthetic_adapter_and_scales_llama_cpp_cannot_express_by_one_alpha(
    base: gguf_lora.BaseGGUF, tmp_path: Path
) -> None:
    from loraplex.engine.lora.synthetic import SyntheticAdapter

    synthetic = SyntheticAdapter(base.shape, seed=1, rank=4)
    alpha, tensors = gguf_lora.lora_tensors(synthetic, base)
    assert alpha == 4.0 and len(tensors) == 2 * 4 * base.config.num_layers  # q k v o, alpha = rank
    weights = synthetic.load(torch.float32)
    np.testing.assert_array_equal(tensors["blk.0.attn_output.weight.lora_b"], weights[(0, "o")][1].numpy())

    # rslora or alpha_pattern: per-module scales no single alpha gives; folded into B, alpha 0
    # (llama.cpp then scales by the adapter scale alone, 1.0).
    modules = tuple(
        SimpleNamespace(layer=0, module=m.module, rank=4, scale=s)
        for m, s in zip(synthetic.manifest.modules[:2], (0.5, 3.0), strict=True)
    )
    odd = SimpleNamespace(
        manifest=SimpleNamespace(config=SimpleNamespace(lora_alpha=4.0), modules=modules),
        load=synthetic.load,
    )
    alpha, folded = gguf_lora.lora_tensors(odd, base)
    assert alpha == 0.0
    q_b = gguf_lora.permute_rows(weights[(0, "q")][1].numpy(), base.config.num_heads)
    np.testing.assert_allclose(folded["blk.0.attn_q.weight.lora_b"], 0.5 * q_b, rtol=1e-6)
    k_b = gguf_lora.permute_rows(weights[(0, "k")][1].numpy(), base.config.num_kv_heads)
    np.testing.assert_allclose(folded["blk.0.attn_k.weight.lora_b"], 3.0 * k_b, rtol=1e-6)
    path = gguf_lora.write_lora_gguf(odd, base, tmp_path / "folded.gguf")
    assert read_back(path)[0]["adapter.lora.alpha"] == 0.0
