"""Read a GGUF file: its Llama config, its tokenizer, and its tensors dequantized to float32, or Q4_0/Q4_1
projections kept as int4 codes (quant.py's QuantizedWeight, group 32) when an int4 model is asked for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ModelConfig
from .errors import ModelLoadError
from .quant import QuantizedWeight, pack_int4, select_rows
from .quant_formats import GGUF_GROUP_SIZE

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

# GGUF tensor names (per block and global) and the Hugging Face names the model loads.
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every key-value field of a GGUFReader as plain Python values."""
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            metadata[key] = field.contents()
        except Exception:  # a field type this gguf version cannot decode is not one we read
            continue
    return metadata


def config_from_metadata(metadata: dict[str, Any], tensor_names: set[str], path: Path) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata has no {arch}.{key}")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = int(metadata.get(f"{arch}.vocab_size") or (len(tokens) if tokens else 0))
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        name=str(metadata.get("general.name") or path.stem),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(metadata.get(f"{arch}.attention.key_length") or hidden // heads),
        vocab_size=vocab,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=arch == "qwen2",
        bos_token_id=_optional_int(metadata.get("tokenizer.ggml.bos_token_id")),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp reorders q and k rows so rotary pairs sit side by side; undo it for rotate-half RoPE.
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def load_gguf(
    path: Path, keep_int4: bool = False
) -> tuple[ModelConfig, dict[str, Any], dict[str, torch.Tensor | QuantizedWeight]]:
    """(config, metadata, Hugging Face-named float32 tensors) of a GGUF file. With `keep_int4`, Q4_0 and
    Q4_1 weight matrices come as int4 QuantizedWeights (float32 scales) without a float round trip."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc
    metadata = read_metadata(reader)
    config = config_from_metadata(metadata, {t.name for t in reader.tensors}, path)
    arch = metadata["general.architecture"]
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            if tensor.name == "rope_freqs.weight":
                raise ModelLoadError(
                    f"{path}: per-frequency RoPE factors (rope_freqs.weight) are not supported"
                )
            continue
        if keep_int4 and tensor.tensor_type.name in _INT4_BLOCKS and len(tensor.shape) == 2:
            weights[name] = _int4_weight(tensor, arch, config)
            continue
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} uses quant type {tensor.tensor_type.name}, which cannot be "
                f"dequantized ({exc})"
            ) from exc
        # GGUF lists dimensions fastest first; numpy wants them slowest first.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        values = np.asarray(values, dtype=np.float32).reshape(shape)
        if arch == "llama" and tensor.name.endswith("attn_q.weight"):
            values = _unpermute(values, config.num_heads)
        elif arch == "llama" and tensor.name.endswith("attn_k.weight"):
            values = _unpermute(values, config.num_kv_heads)
        weights[name] = torch.from_numpy(np.array(values, dtype=np.float32, order="C", copy=True))
    return config, metadata, weights


# Q4_0: fp16 d, then 16 bytes of codes, w = d (q - 8); Q4_1: fp16 d, fp16 m, 16 bytes, w = d q + m.
# In both, byte j of a block holds weight j in its low nibble and weight j + 16 in its high nibble.
_INT4_BLOCKS = {"Q4_0": 18, "Q4_1": 20}


def _int4_weight(tensor: Any, arch: str, config: ModelConfig) -> QuantizedWeight:
    rows, cols = (int(d) for d in reversed(tensor.shape))
    kind = tensor.tensor_type.name
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(
        rows, cols // GGUF_GROUP_SIZE, _INT4_BLOCKS[kind]
    )
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
    else:
        m = -8.0 * d
        qs = blocks[..., 2:]
    codes = np.concatenate((qs & 0x0F, qs >> 4), axis=-1).reshape(rows, cols)  # [N, K], block order
    weight = QuantizedWeight(
        "int4",
        pack_int4(torch.from_numpy(codes)),
        torch.from_numpy(np.ascontiguousarray(d)),
        torch.from_numpy(np.ascontiguousarray(m)),
        GGUF_GROUP_SIZE,
        rows,
        cols,
    )
    heads = {"attn_q.weight": config.num_heads, "attn_k.weight": config.num_kv_heads}.get(
        tensor.name.split(".", 2)[-1]
    )
    if arch == "llama" and heads is not None:  # the same row order _unpermute restores for floats
        order = _unpermute(np.arange(rows), heads)
        weight = select_rows(weight, torch.from_numpy(np.ascontiguousarray(order)))
    return weight


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
    return None
