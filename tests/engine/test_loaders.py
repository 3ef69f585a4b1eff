"""Loaders: Hugging Face directories and GGUF files give the same model as transformers; bad input
gets one clear error naming the problem."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from loraplex.engine.kernels.reference import causal_attention
from loraplex.engine.model.config import ModelConfig, RopeScaling, named_shape
from loraplex.engine.model.errors import ModelLoadError
from loraplex.engine.model.llama import LlamaModel
from loraplex.engine.model.loader import load_model
from loraplex.engine.model.rope import inverse_frequencies

VOCAB = 300


def tiny_hf_model(tmp_path: Path, model_type: str = "llama", **extra):
    """A random transformers model saved as safetensors; returns (directory, transformers model)."""
    import transformers

    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    kwargs.update(extra)
    if model_type == "qwen2":
        config = transformers.Qwen2Config(**kwargs)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**kwargs)
        model = transformers.LlamaForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.eval()
    directory = tmp_path / f"hf-{model_type}"
    model.save_pretrained(directory, safe_serialization=True)
    return directory, model


def our_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    scale = model.config.head_dim**-0.5
    with torch.inference_mode():
        return model(
            torch.tensor(ids),
            torch.arange(len(ids)),
            lambda i, q, k, v: causal_attention(q, k, v, scale),
            torch.arange(len(ids)),
        )


def assert_matches_transformers(ours: LlamaModel, theirs, ids: list[int]) -> None:
    with torch.inference_mode():
        expected = theirs(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(our_logits(ours, ids), expected, rtol=1e-4, atol=1e-4)


IDS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 1, 77, 200]


@pytest.mark.parametrize(
    "model_type,extra",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
                "rope_theta": 500000.0,
            },
        ),
        ("qwen2", {}),
    ],
)
def test_hf_directory_matches_transformers(tmp_path: Path, model_type: str, extra: dict) -> None:
    directory, theirs = tiny_hf_model(tmp_path, model_type, **extra)
    loaded = load_model(directory)
    assert loaded.config.tie_word_embeddings == extra.get("tie_word_embeddings", False)
    assert_matches_transformers(loaded.model, theirs, IDS)


def test_llama3_rope_frequencies_match_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    hf_config = LlamaConfig(
        hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, rope_scaling=scaling
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = inverse_frequencies(named_shape("llama3-8b"))
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(
    path: Path,
    state: dict[str, torch.Tensor],
    config: ModelConfig,
    arch: str = "llama",
    q8_1_tensor: str | None = None,
    quant_types: dict[str, Any] | None = None,
) -> None:
    """A GGUF the way llama.cpp's converter writes one (q and k rows permuted), with a byte-level vocab."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokens = sorted(alphabet) + ["Ġt", "<|end|>"] + [f"tok{i}" for i in range(VOCAB - len(alphabet) - 2)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(["Ġ t"])
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_eos_token_id(len(tokens) - 1)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    block = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for name, tensor in state.items():
        if name.startswith("model.layers."):
            _, _, index, rest = name.split(".", 3)
            gguf_name = f"blk.{index}.{block[rest]}"
        else:
            gguf_name = names[name]
        array = tensor.float().numpy()
        if gguf_name.endswith("attn_q.weight"):
            array = _llama_cpp_permute(array, config.num_heads)
        elif gguf_name.endswith("attn_k.weight"):
            array = _llama_cpp_permute(array, config.num_kv_heads)
        if gguf_name == q8_1_tensor:
            rows, cols = array.shape
            block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
            raw = np.zeros((rows, cols // block_size * type_size), dtype=np.uint8)
            writer.add_tensor(gguf_name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        elif quant_types and gguf_name.split(".")[-2] in quant_types:  # e.g. {"attn_q": Q4_0}
            qtype = quant_types[gguf_name.split(".")[-2]]
            raw = gguf.quants.quantize(np.ascontiguousarray(array), qtype)
            writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_undoes_llama_cpp_permutation(tmp_path: Path) -> None:
    directory, theirs = tiny_hf_model(tmp_path)
    config = load_model(directory).config
    path = tmp_path / "tiny.gguf"
    write_gguf(path, theirs.state_dict(), config)
    loaded = load_model(path)
    assert loaded.config.num_kv_heads == 2 and not loaded.config.tie_word_embeddings
    assert_matches_transformers(loaded.model, theirs, IDS)
    assert loaded.tokenizer is not None and loaded.tokenizer.eos_token_ids == (VOCAB - 1,)


def test_smollm2_gguf_config(smollm2) -> None:
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0


def test_random_named_shape_is_reproducible() -> None:
    a = load_model("random:tiny", seed=3).model
    b = load_model("random:tiny", seed=3).model
    c = load_model("random:tiny", seed=4).model
    assert torch.equal(a.layers[0].qkv_proj, b.layers[0].qkv_proj)
    assert not torch.equal(a.layers[0].qkv_proj, c.layers[0].qkv_proj)
    assert named_shape("llama-7b").num_parameters() == pytest.approx(6.74e9, rel=0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_model_runs_in_each_dtype(dtype: torch.dtype) -> None:
    model = load_model("random:tiny", dtype=dtype).model
    logits = our_logits(model, [1, 2, 3])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


# -- errors -------------------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")


def test_unknown_named_shape() -> None:
    with pytest.raises(ValueError, match="unknown model shape 'gpt-5'"):
        load_model("random:gpt-5")


def test_unsupported_hf_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="model_type 'gpt2' is not supported"):
        load_model(tmp_path)


def test_hf_shape_mismatch_names_the_tensor(tmp_path: Path) -> None:
    directory, _ = tiny_hf_model(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["intermediate_size"] = 128
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"shape mismatch for model\.layers\.0\.mlp\.gate_proj\.weight"):
        load_model(directory)


def test_pickled_weights_are_refused(tmp_path: Path) -> None:
    directory, _ = tiny_hf_model(tmp_path)
    for file in directory.glob("*.safetensors"):
        file.rename(file.with_suffix(".bin"))
    with pytest.raises(ModelLoadError, match="pickled weights are refused"):
        load_model(directory)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    directory, theirs = tiny_hf_model(tmp_path)
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, theirs.state_dict(), load_model(directory).config, arch="gpt2")
    with pytest.raises(ModelLoadError, match="architecture 'gpt2' is not supported"):
        load_model(path)


def test_unsupported_gguf_quant_type_names_tensor_and_type(tmp_path: Path) -> None:
    directory, theirs = tiny_hf_model(tmp_path)
    path = tmp_path / "q81.gguf"
    write_gguf(path, theirs.state_dict(), load_model(directory).config, q8_1_tensor="blk.1.ffn_up.weight")
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_up\.weight uses quant type Q8_1"):
        load_model(path)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"definitely not gguf")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(path)


def test_bad_model_config_values() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig(
            hidden_size=64, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=3, vocab_size=8
        )
    with pytest.raises(ValueError, match="high_freq_factor"):
        RopeScaling(8.0, 4.0, 1.0, 8192)
