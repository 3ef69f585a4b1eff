"""Inspect a PEFT LoRA directory against a base model: what it adapts, at which ranks, and its identity.

The digest of the whole adapter (config and weights, adapters/digest.py) is its identity everywhere
(store, engine, database).
Torch-free, so the control plane validates uploads with exactly the checks the engine relies on.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from .digest import adapter_digest
from .errors import AdapterError
from .peft_config import CONFIG_FILE, LoraConfig, read_config
from .safetensors_header import FLOAT_DTYPES, read_header
from .shapes import MODULE_PATHS, BaseShape, module_name
from .strict_json import shown
from .weights import check_finite

WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_LEAVES = {path.rsplit(".", 1)[1]: short for short, path in MODULE_PATHS.items()}
# ASCII only and a layer of at most six digits without leading zeros: "model.layers.007" or a Unicode
# digit must not alias layer 7, and int() never sees a 5000-digit run. fullmatch: `$` would allow "\n".
_TENSOR_NAME = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(?P<layer>0|[1-9][0-9]{0,5})\.(?:self_attn|mlp)\."
    r"(?P<leaf>[A-Za-z0-9_]+)\.(?:lora_(?P<part>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight"
    # DoRA's magnitude vector: PEFT saves it bare (0.12 on), older versions with .weight
    r"|lora_magnitude_vector(?:\.weight)?)",
    re.ASCII,
)


def parse_tensor_name(name: str) -> tuple[int, str, str] | None:
    """(layer, short module, "A", "B" or "M") of a PEFT LoRA tensor name, or None if it is not one
    ("M": a DoRA magnitude vector)."""
    match = _TENSOR_NAME.fullmatch(name)
    if match is None or match["leaf"] not in _LEAVES:
        return None
    return int(match["layer"]), _LEAVES[match["leaf"]], match["part"] or "M"


@dataclass(frozen=True)
class ModuleLora:
    layer: int
    module: str  # short name: q k v o gate up down
    rank: int
    scale: float
    in_features: int
    out_features: int
    dora: bool = False  # a DoRA module: its magnitude vector [out_features] comes with A and B


@dataclass(frozen=True)
class AdapterManifest:
    sha256: str
    config: LoraConfig
    modules: tuple[ModuleLora, ...]
    weights_bytes: int
    dtype: str

    @property
    def target_modules(self) -> tuple[str, ...]:
        seen = dict.fromkeys(m.module for m in self.modules)
        return tuple(seen)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({m.rank for m in self.modules}))

    @property
    def num_parameters(self) -> int:
        return sum(m.rank * (m.in_features + m.out_features) + m.dora * m.out_features for m in self.modules)

    @property
    def dora(self) -> bool:
        return self.config.use_dora


def _part_name(part: str) -> str:
    return "lora_magnitude_vector" if part == "M" else f"lora_{part}"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def inspect_adapter(directory: str | Path, base: BaseShape) -> AdapterManifest:
    """Validate a PEFT LoRA directory for `base`; raise AdapterError naming the first problem."""
    directory = Path(directory)
    if not directory.is_dir():
        raise AdapterError(f"adapter directory {directory} does not exist")
    pickled = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLED_SUFFIXES)
    if pickled:
        raise AdapterError(f"{pickled[0]} is refused: weights must be safetensors, never pickled")
    config = read_config(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterError(f"{WEIGHTS_FILE} is missing next to {CONFIG_FILE}")
    tensors = read_header(weights)

    found: dict[tuple[int, str, str], tuple[str, tuple[int, ...], str]] = {}
    for name, info in tensors.items():
        key = parse_tensor_name(name)
        if key is None:
            raise AdapterError(
                f"{WEIGHTS_FILE}: tensor {shown(name)} is not a LoRA A/B weight (or DoRA magnitude) of a "
                "supported projection"
            )
        if info.dtype not in FLOAT_DTYPES:
            raise AdapterError(
                f"{WEIGHTS_FILE}: tensor {shown(name)} has dtype {info.dtype}; expected F32, F16 or BF16"
            )
        if key in found:  # e.g. with and without the base_model.model. prefix: which one would load?
            raise AdapterError(
                f"{WEIGHTS_FILE}: tensors {shown(found[key][0])} and {shown(name)} are both layer {key[0]} "
                f"{key[1]} {_part_name(key[2])}"
            )
        found[key] = (name, info.shape, info.dtype)

    modules = []
    targeted = config.targeted(base)
    if not targeted:
        raise AdapterError("target_modules matches none of the base model's projections")
    for layer, module in targeted:
        full = module_name(layer, module)
        rank = config.rank_of(full)
        in_features, out_features = base.features(module)
        parts: list[tuple[str, tuple[int, ...]]] = [("A", (rank, in_features)), ("B", (out_features, rank))]
        if config.use_dora:
            parts.append(("M", (out_features,)))
        for part, expected in parts:
            if (layer, module, part) not in found:
                raise AdapterError(
                    f"layer {layer} {module}: {_part_name(part)} is missing from {WEIGHTS_FILE}"
                    + (" (use_dora is true)" if part == "M" else "")
                )
            name, shape, _ = found.pop((layer, module, part))
            if shape != expected:
                raise AdapterError(
                    f"layer {layer} {module}: {_part_name(part)} has shape {list(shape)}, the base model "
                    f"needs {list(expected)} (rank {rank}, {in_features} in, {out_features} out)"
                )
        modules.append(
            ModuleLora(layer, module, rank, config.scale_of(full), in_features, out_features, config.use_dora)
        )
    if found:
        layer, module, part = min(found)
        if layer >= base.num_layers:
            raise AdapterError(
                f"{shown(found[(layer, module, part)][0])}: layer {layer} is past the base model's "
                f"{base.num_layers} layers"
            )
        if part == "M" and not config.use_dora:
            raise AdapterError(
                f"{shown(found[(layer, module, part)][0])} is a DoRA magnitude vector, but "
                "adapter_config.json does not set use_dora"
            )
        raise AdapterError(f"{shown(found[(layer, module, part)][0])} is not targeted by adapter_config.json")
    check_finite(weights, tensors)  # reads every weight: last, after the checks that cost nothing
    dtypes = sorted({info.dtype for info in tensors.values()})
    return AdapterManifest(
        sha256=adapter_digest(directory),  # the whole adapter's identity: config and weights
        config=config,
        modules=tuple(modules),
        weights_bytes=weights.stat().st_size,
        dtype=dtypes[0] if len(dtypes) == 1 else "mixed",
    )
