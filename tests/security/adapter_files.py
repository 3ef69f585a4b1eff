"""Adapter files written byte by byte (no torch, no PEFT), so a test puts any flaw exactly where it wants."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from loraplex.adapters import BaseShape

TINY_SHAPE = BaseShape(num_layers=2, hidden_size=64, intermediate_size=96, q_size=64, kv_size=32)
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_NUMPY_DTYPES = {"F32": "<f4", "F16": "<f2"}


def tensor_name(layer: int, module: str, part: str) -> str:
    group = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"base_model.model.model.layers.{layer}.{group}.{module}.lora_{part}.weight"


def safetensors_bytes(header: dict[str, Any] | bytes, data: bytes = b"") -> bytes:
    """A safetensors file: the 8-byte little-endian header length, the header, then `data`."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def encode(values: np.ndarray, dtype: str) -> bytes:
    """Little-endian bytes of float32 `values` as F32, F16 or BF16 (BF16: the top half of each F32)."""
    if dtype == "BF16":
        return (values.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
    return values.astype(_NUMPY_DTYPES[dtype]).tobytes()


def lora_tensors(
    rank: int = 2,
    modules: tuple[str, ...] = ("q_proj", "v_proj"),
    shape: BaseShape = TINY_SHAPE,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Random A [rank, in] and B [out, rank] for every module of every layer."""
    short = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate"}
    short |= {"up_proj": "up", "down_proj": "down"}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(shape.num_layers):
        for module in modules:
            in_features, out_features = shape.features(short[module])
            tensors[tensor_name(layer, module, "A")] = rng.normal(0, 0.1, (rank, in_features)).astype("f4")
            tensors[tensor_name(layer, module, "B")] = rng.normal(0, 0.1, (out_features, rank)).astype("f4")
    return tensors


def weights_bytes(tensors: dict[str, np.ndarray], dtype: str = "F32") -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    chunks, offset = [], 0
    for name, values in tensors.items():
        data = encode(values, dtype)
        header[name] = {
            "dtype": dtype,
            "shape": list(values.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    return safetensors_bytes(header, b"".join(chunks))


def config_dict(rank: int = 2, modules: tuple[str, ...] = ("q_proj", "v_proj")) -> dict[str, Any]:
    return {"peft_type": "LORA", "r": rank, "lora_alpha": 4, "target_modules": list(modules), "bias": "none"}


def write_adapter(
    directory: Path,
    config: dict[str, Any] | str | None = None,
    weights: bytes | None = None,
) -> Path:
    """A valid rank-2 q/v adapter for TINY_SHAPE, with the config (a dict or raw JSON text) or the weights
    file replaced when given."""
    directory.mkdir(parents=True, exist_ok=True)
    config = config_dict() if config is None else config
    text = config if isinstance(config, str) else json.dumps(config)
    (directory / CONFIG).write_text(text, encoding="utf-8", errors="surrogatepass")
    (directory / WEIGHTS).write_bytes(weights_bytes(lora_tensors()) if weights is None else weights)
    return directory
