"""Read a Hugging Face model directory: config.json and one or several *.safetensors files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from loraplex.adapters.errors import AdapterError
from loraplex.adapters.strict_json import loads_strict

from . import config_fields as fields
from .config import ModelConfig, RopeScaling
from .errors import ModelLoadError
from .limits import (
    MAX_CONFIG_JSON_BYTES,
    MAX_CONFIG_JSON_DEPTH,
    MAX_CONTEXT_LENGTH,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN_SIZE,
    MAX_INTERMEDIATE_SIZE,
    MAX_LAYERS,
    MAX_VOCAB_SIZE,
)
from .llama import check_shapes

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def config_from_hf(raw: dict[str, Any], path: Path) -> ModelConfig:
    """The model's shape from config.json, each field type- and range-checked under its own name."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{path}: model_type {str(model_type)[:60]!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if key not in raw:
            raise ModelLoadError(f"{path}: config.json has no {key}")

    def count(key: str, maximum: int, default: Any = None) -> int:
        value = raw.get(key)
        return fields.integer(default if value is None else value, key, path, 1, maximum)

    def flag(key: str, default: bool) -> bool:
        value = raw.get(key)
        return default if value is None else fields.flag(value, key, path)

    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(
            f"{path}: hidden_act {str(raw['hidden_act'])[:60]!r} is not supported (only silu)"
        )
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(f"{path}: rope_scaling must be an object, got {type(rope).__name__}")
    heads = count("num_attention_heads", MAX_HEADS)
    hidden = count("hidden_size", MAX_HIDDEN_SIZE)
    return fields.build(
        lambda: ModelConfig(
            name=fields.text(raw.get("_name_or_path") or path.name, "_name_or_path", path),
            hidden_size=hidden,
            intermediate_size=count("intermediate_size", MAX_INTERMEDIATE_SIZE),
            num_layers=count("num_hidden_layers", MAX_LAYERS),
            num_heads=heads,
            num_kv_heads=count("num_key_value_heads", MAX_HEADS, heads),
            head_dim=count("head_dim", MAX_HEAD_DIM, max(hidden // heads, 1)),
            vocab_size=count("vocab_size", MAX_VOCAB_SIZE),
            rms_norm_eps=fields.positive_real(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", path),
            rope_theta=fields.positive_real(
                rope.get("rope_theta", raw.get("rope_theta", 10000.0)), "rope_theta", path
            ),
            rope_scaling=_rope_scaling(rope, path),
            max_position_embeddings=count("max_position_embeddings", MAX_CONTEXT_LENGTH, 4096),
            tie_word_embeddings=flag("tie_word_embeddings", False),
            attention_bias=flag("attention_bias", model_type == "qwen2"),
            bos_token_id=fields.token_id(raw.get("bos_token_id"), "bos_token_id", path),
            eos_token_ids=fields.token_ids(raw.get("eos_token_id"), "eos_token_id", path),
        ),
        path,
    )


def _rope_scaling(rope: dict[str, Any], path: Path) -> RopeScaling | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("default", None):
        return None
    if rope_type != "llama3":
        raise ModelLoadError(
            f"{path}: rope scaling type {str(rope_type)[:60]!r} is not supported (only llama3)"
        )

    def real(key: str) -> float:
        return fields.positive_real(rope.get(key), f"rope_scaling.{key}", path)

    return fields.build(
        lambda: RopeScaling(
            factor=real("factor"),
            low_freq_factor=real("low_freq_factor"),
            high_freq_factor=real("high_freq_factor"),
            original_max_position_embeddings=fields.integer(
                rope.get("original_max_position_embeddings"),
                "rope_scaling.original_max_position_embeddings",
                path,
                1,
                MAX_CONTEXT_LENGTH,
            ),
        ),
        path,
    )


def load_hf_directory(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, tensors) of a Hugging Face directory. config.json is read bounded (size, depth, strict
    numbers) and checked against the safetensors headers' shapes before any tensor is read."""
    from safetensors.torch import load_file

    config = config_from_hf(_read_config(path), path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {', '.join(pickled)}: pickled weights are refused)" if pickled else ""
        raise ModelLoadError(f"{path}: no *.safetensors weights{hint}")
    try:
        check_shapes(config, _tensor_shapes(files), "num_hidden_layers")
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            weights.update(load_file(str(file)))
        except Exception as exc:
            raise ModelLoadError(f"{file}: unreadable safetensors file ({exc})") from exc
    return config, weights


def _read_config(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{path}: no config.json (a Hugging Face model directory needs one)")
    size = config_path.stat().st_size
    if size > MAX_CONFIG_JSON_BYTES:
        raise ModelLoadError(
            f"{config_path}: {size} bytes; a config.json has at most {MAX_CONFIG_JSON_BYTES}"
        )
    try:
        raw = loads_strict(config_path.read_bytes(), str(config_path), MAX_CONFIG_JSON_DEPTH)
    except AdapterError as exc:  # the shared strict JSON reader speaks in adapter errors
        raise ModelLoadError(str(exc)) from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_path}: must hold a JSON object, got {type(raw).__name__}")
    return raw


def _tensor_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from the files' headers alone (safetensors checks them against the file size);
    a name in two files is refused, since which copy would load depends on the order files are read."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
                    if name in shapes:
                        raise ModelLoadError(f"{file}: tensor {name[:200]!r} is also in another file")
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"{file}: unreadable safetensors file ({exc})") from exc
    return shapes
