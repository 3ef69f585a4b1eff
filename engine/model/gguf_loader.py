"""Read a GGUF file: its Llama config, its tokenizer, and its tensors dequantized to float32, or Q4_0/Q4_1
projections kept as int4 codes (quant.py's QuantizedWeight, group 32) when an int4 model is asked for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from . import config_fields as fields
from .config import ModelConfig
from .errors import ModelLoadError
from .gguf_dequant import dequantize_blocks, fast_types
from .gguf_header import GGUFTensorInfo, parse_gguf_header
from .limits import (
    MAX_CONTEXT_LENGTH,
    MAX_GGUF_HEADER_BYTES,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN_SIZE,
    MAX_INTERMEDIATE_SIZE,
    MAX_LAYERS,
    MAX_VOCAB_SIZE,
)
from .llama import check_shapes
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


# Tokenizer fields the engine reads, and the type each must have (tokenizer.py trusts them).
_TOKENIZER_STRINGS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")
_TOKENIZER_LISTS: dict[str, type] = {
    "tokenizer.ggml.tokens": str,
    "tokenizer.ggml.merges": str,
    "tokenizer.ggml.token_type": int,
}
_TOKENIZER_IDS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every key-value field of a `gguf.GGUFReader` as plain Python values (the bench tools read the GGUF
    files they write with it; models are loaded through the bounded gguf_header parser instead)."""
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            metadata[key] = field.contents()
        except Exception:  # a field type this gguf version cannot decode is not one we read
            continue
    return metadata


def config_from_metadata(metadata: dict[str, Any], tensor_names: set[str], path: Path) -> ModelConfig:
    """The model's shape from GGUF metadata, each field type- and range-checked under its GGUF name."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {str(arch)[:60]!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def count(key: str, maximum: int, default: Any = None, minimum: int = 1) -> int:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata has no {arch}.{key}")
        return fields.integer(value, f"{arch}.{key}", path, minimum, maximum)

    def real(key: str, default: float) -> float:
        return fields.positive_real(metadata.get(f"{arch}.{key}", default), f"{arch}.{key}", path)

    _check_tokenizer_fields(metadata, path)
    heads = count("attention.head_count", MAX_HEADS)
    hidden = count("embedding_length", MAX_HIDDEN_SIZE)
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = metadata.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    eos = fields.token_id(metadata.get("tokenizer.ggml.eos_token_id"), "tokenizer.ggml.eos_token_id", path)
    name = metadata.get("general.name") or path.stem
    return fields.build(
        lambda: ModelConfig(
            name=fields.text(name, "general.name", path),
            hidden_size=hidden,
            intermediate_size=count("feed_forward_length", MAX_INTERMEDIATE_SIZE),
            num_layers=count("block_count", MAX_LAYERS),
            num_heads=heads,
            num_kv_heads=count("attention.head_count_kv", MAX_HEADS, heads),
            head_dim=count("attention.key_length", MAX_HEAD_DIM, max(hidden // heads, 1)),
            vocab_size=fields.integer(
                vocab,
                f"{arch}.vocab_size (else the length of tokenizer.ggml.tokens)",
                path,
                1,
                MAX_VOCAB_SIZE,
            ),
            rms_norm_eps=real("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=real("rope.freq_base", 10000.0),
            max_position_embeddings=count("context_length", MAX_CONTEXT_LENGTH, 4096),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias=arch == "qwen2",
            bos_token_id=fields.token_id(
                metadata.get("tokenizer.ggml.bos_token_id"), "tokenizer.ggml.bos_token_id", path
            ),
            eos_token_ids=(eos,) if eos is not None else (),
        ),
        path,
    )


def _check_tokenizer_fields(metadata: dict[str, Any], path: Path) -> None:
    for key in _TOKENIZER_STRINGS:
        if key in metadata:
            fields.text(metadata[key], key, path, max_chars=MAX_GGUF_HEADER_BYTES)
    for key, item in _TOKENIZER_LISTS.items():
        if key in metadata:
            fields.list_of(metadata[key], item, key, path)
    for key in _TOKENIZER_IDS:
        fields.token_id(metadata.get(key), key, path)
    if "tokenizer.ggml.add_bos_token" in metadata:
        fields.flag(metadata["tokenizer.ggml.add_bos_token"], "tokenizer.ggml.add_bos_token", path)


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
    Q4_1 weight matrices come as int4 QuantizedWeights (float32 scales) without a float round trip.

    The header is parsed with every length bounded by the file (gguf_header.py) and the config checked
    against the tensors' shapes before a single tensor is dequantized or the model allocated."""
    from gguf.quants import dequantize

    data = _map(path)
    header = parse_gguf_header(data, str(path))
    metadata = header.metadata
    config = config_from_metadata(metadata, {t.name for t in header.tensors}, path)
    arch = metadata["general.architecture"]
    tensors: dict[str, GGUFTensorInfo] = {}
    for tensor in header.tensors:
        name = _hf_name(tensor.name)
        if name is not None:
            tensors[name] = tensor
        elif tensor.name == "rope_freqs.weight":
            raise ModelLoadError(f"{path}: per-frequency RoPE factors (rope_freqs.weight) are not supported")
    try:
        check_shapes(config, {name: t.shape for name, t in tensors.items()}, f"{arch}.block_count")
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name, tensor in tensors.items():
        raw = _tensor_data(data, tensor)
        if keep_int4 and tensor.ggml_type.name in _INT4_BLOCKS and len(tensor.dims) == 2:
            weights[name] = _int4_weight(tensor, raw, arch, config)
            continue
        try:
            if tensor.ggml_type.name in fast_types():
                values = dequantize_blocks(raw, tensor.ggml_type.name)
            else:
                values = dequantize(raw, tensor.ggml_type)
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} uses quant type {tensor.ggml_type.name}, which cannot be "
                f"dequantized ({exc})"
            ) from exc
        values = np.asarray(values, dtype=np.float32).reshape(tensor.shape)
        if arch == "llama" and tensor.name.endswith("attn_q.weight"):
            values = _unpermute(values, config.num_heads)
        elif arch == "llama" and tensor.name.endswith("attn_k.weight"):
            values = _unpermute(values, config.num_kv_heads)
        weights[name] = torch.from_numpy(np.array(values, dtype=np.float32, order="C", copy=True))
    return config, metadata, weights


def int4_share(path: Path) -> float:
    """The share of the file's 2-D layer weights stored as Q4_0/Q4_1 blocks (read from the header only):
    what quantization `auto` keeps as int4 when it is most of them."""
    header = parse_gguf_header(_map(path), str(path))
    matrices = [t for t in header.tensors if t.name.startswith("blk.") and len(t.dims) == 2]
    if not matrices:
        return 0.0
    return sum(t.ggml_type.name in _INT4_BLOCKS for t in matrices) / len(matrices)


def _map(path: Path) -> np.memmap:
    """The file, memory-mapped read-only: the header is parsed and the tensors viewed in place."""
    try:
        return np.memmap(path, mode="r")
    except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from None


# Types with a numpy dtype are viewed as it; the others as their bytes, which dequantize() decodes.
_NUMPY_TYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


def _tensor_data(data: np.memmap, tensor: GGUFTensorInfo) -> np.ndarray:
    """The tensor's bytes in the map, shaped as the `gguf` package's reader shapes them."""
    raw = data[tensor.offset : tensor.offset + tensor.n_bytes]
    dtype = _NUMPY_TYPES.get(tensor.ggml_type)
    if dtype is not None:
        return raw.view(dtype).reshape(tensor.shape)
    return raw.reshape(quant_shape_to_byte_shape(tensor.shape, tensor.ggml_type))


# Q4_0: fp16 d, then 16 bytes of codes, w = d (q - 8); Q4_1: fp16 d, fp16 m, 16 bytes, w = d q + m.
# In both, byte j of a block holds weight j in its low nibble and weight j + 16 in its high nibble.
_INT4_BLOCKS = {"Q4_0": 18, "Q4_1": 20}


def _int4_weight(tensor: GGUFTensorInfo, raw: np.ndarray, arch: str, config: ModelConfig) -> QuantizedWeight:
    rows, cols = tensor.shape
    kind = tensor.ggml_type.name
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // GGUF_GROUP_SIZE, _INT4_BLOCKS[kind])
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
