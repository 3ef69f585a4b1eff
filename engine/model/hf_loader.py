"""Read a Hugging Face model directory: config.json and one or several *.safetensors files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig, RopeScaling
from .errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def config_from_hf(raw: dict[str, Any], path: Path) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{path}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if key not in raw:
            raise ModelLoadError(f"{path}: config.json has no {key}")
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type == "llama3":
        scaling = RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    elif rope_type not in ("default", None):
        raise ModelLoadError(f"{path}: rope scaling type {rope_type!r} is not supported (only llama3)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    heads = int(raw["num_attention_heads"])
    return ModelConfig(
        name=str(raw.get("_name_or_path") or path.name),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        vocab_size=int(raw["vocab_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def load_hf_directory(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{path}: no config.json (a Hugging Face model directory needs one)")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_path}: not valid JSON ({exc})") from exc
    config = config_from_hf(raw, path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {', '.join(pickled)}: pickled weights are refused)" if pickled else ""
        raise ModelLoadError(f"{path}: no *.safetensors weights{hint}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            weights.update(load_file(str(file)))
        except Exception as exc:
            raise ModelLoadError(f"{file}: unreadable safetensors file ({exc})") from exc
    return config, weights
