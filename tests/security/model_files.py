"""Model files for the hostile-model tests: a tiny valid GGUF and Hugging Face directory (any field
overridden), and GGUF headers written byte by byte, so a test puts a flaw exactly where it wants."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value types (the spec's numbering).
UINT8, UINT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT32 = 0, 4, 6, 7, 8, 9, 10, 5
F32 = 0  # ggml tensor type

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 16, 32, 2, 2, 1, 8


def _byte_level_tokens() -> list[str]:
    from tokenizers import pre_tokenizers

    return [*sorted(pre_tokenizers.ByteLevel.alphabet()), "Ġt", "<|end|>"]


TOKENS = _byte_level_tokens()
VOCAB = len(TOKENS)


def tiny_tensors() -> dict[str, tuple[int, ...]]:
    """GGUF tensor names of the tiny llama and their shapes (slowest first), tied embeddings."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (VOCAB, HIDDEN),
        "output_norm.weight": (HIDDEN,),
    }
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (HIDDEN,),
            f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (q, HIDDEN),
            f"blk.{i}.attn_k.weight": (kv, HIDDEN),
            f"blk.{i}.attn_v.weight": (kv, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, q),
            f"blk.{i}.ffn_gate.weight": (INTERMEDIATE, HIDDEN),
            f"blk.{i}.ffn_up.weight": (INTERMEDIATE, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, INTERMEDIATE),
        }
    return shapes


def tiny_metadata() -> dict[str, Any]:
    return {
        "general.name": "tiny",
        "llama.block_count": LAYERS,
        "llama.context_length": 64,
        "llama.embedding_length": HIDDEN,
        "llama.feed_forward_length": INTERMEDIATE,
        "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS,
        "llama.rope.freq_base": 10000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.merges": ["Ġ t"],
        "tokenizer.ggml.token_type": [1] * (VOCAB - 1) + [3],
        "tokenizer.ggml.eos_token_id": VOCAB - 1,
    }


def write_tiny_gguf(path: Path, overrides: dict[str, Any] | None = None, drop: tuple[str, ...] = ()) -> Path:
    """The tiny llama as GGUF (gguf's own writer), its metadata keys overridden (a value of (type, value)
    forces the GGUF value type) or dropped."""
    import gguf

    metadata = {k: v for k, v in (tiny_metadata() | (overrides or {})).items() if k not in drop}
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in metadata.items():
        vtype, value = value if isinstance(value, tuple) else (_value_type(value), value)
        sub = gguf.GGUFValueType(_value_type(value[0])) if isinstance(value, list) and value else None
        writer.add_key_value(key, value, gguf.GGUFValueType(vtype), sub)
    rng = np.random.default_rng(0)
    for name, shape in tiny_tensors().items():
        writer.add_tensor(name, rng.normal(0.0, 0.02, shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _value_type(value: Any) -> int:
    if isinstance(value, bool):
        return BOOL
    if isinstance(value, int):
        return UINT32 if 0 <= value < 2**32 else UINT64 if value >= 0 else INT32
    if isinstance(value, float):
        return FLOAT32
    if isinstance(value, str):
        return STRING
    return ARRAY


def write_tiny_hf(directory: Path, overrides: dict[str, Any] | None = None) -> Path:
    """The tiny llama as a Hugging Face directory: config.json (fields overridden; None drops one) and
    model.safetensors with every tensor the config names."""
    import torch
    from safetensors.torch import save_file

    config = {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
        "tie_word_embeddings": True,
    }
    config = {k: v for k, v in (config | (overrides or {})).items() if v is not None}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }
    tensors = {}
    for name, shape in tiny_tensors().items():
        if name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            hf_name = f"model.layers.{layer}.{names[rest]}"
        else:
            hf_name = names[name]
        tensors[hf_name] = torch.zeros(shape)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


# --- GGUF headers byte by byte ------------------------------------------------------------------------


def gstr(text: str | bytes, length: int | None = None) -> bytes:
    """A GGUF string; `length` claims another byte count than the bytes that follow."""
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def kv(key: str, value_type: int, value: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", value_type) + value


def kv_u32(key: str, value: int) -> bytes:
    return kv(key, UINT32, struct.pack("<I", value))


def kv_array(key: str, item_type: int, count: int, items: bytes = b"") -> bytes:
    return kv(key, ARRAY, struct.pack("<IQ", item_type, count) + items)


def tensor_info(name: str, dims: tuple[int, ...], ggml_type: int = F32, offset: int = 0) -> bytes:
    return gstr(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)


def gguf_bytes(
    kvs: list[bytes] = (),  # type: ignore[assignment]
    tensors: list[bytes] = (),  # type: ignore[assignment]
    data: bytes = b"",
    *,
    kv_count: int | None = None,
    tensor_count: int | None = None,
    version: int = 3,
    alignment: int = 32,
) -> bytes:
    """A GGUF file: header, key-values, tensor infos, padding to `alignment`, `data`. The counts default to
    the truth; give others to lie."""
    head = b"GGUF" + struct.pack(
        "<IQQ",
        version,
        len(tensors) if tensor_count is None else tensor_count,
        len(kvs) if kv_count is None else kv_count,
    )
    body = head + b"".join(kvs) + b"".join(tensors)
    padding = b"\0" * (-len(body) % alignment) if tensors or data else b""
    return body + padding + data
