"""adapter_config.json: parse a PEFT LoRA config and refuse, by field, what loraplex does not serve."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import AdapterError
from .shapes import MODULE_PATHS, MODULES, BaseShape, module_name

CONFIG_FILE = "adapter_config.json"

# Leaf module names ("q_proj") to our short names ("q").
_SHORT_NAMES = {path.rsplit(".", 1)[1]: short for short, path in MODULE_PATHS.items()}
_EMBEDDING_NAMES = ("embed_tokens", "lm_head", "wte", "word_embeddings", "embeddings")


@dataclass(frozen=True)
class LoraConfig:
    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str = ()  # a list (suffix match) or one regex (full match)
    layers_to_transform: tuple[int, ...] | None = None
    exclude_modules: tuple[str, ...] | str | None = None
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    fan_in_fan_out: bool = False
    base_model_name_or_path: str | None = None

    def targets(self, name: str) -> bool:
        """Whether PEFT would wrap the module `name` (e.g. model.layers.3.self_attn.q_proj)."""
        if self.exclude_modules:
            if isinstance(self.exclude_modules, str):
                if re.fullmatch(self.exclude_modules, name):
                    return False
            elif any(name == m or name.endswith(f".{m}") for m in self.exclude_modules):
                return False
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, name) is not None
        found = any(name == t or name.endswith(f".{t}") for t in self.target_modules)
        if found and self.layers_to_transform is not None:
            layer = int(name.split(".")[2])
            found = layer in self.layers_to_transform
        return found

    def rank_of(self, name: str) -> int:
        key = _pattern_key(self.rank_pattern, name)
        return int(self.rank_pattern[key]) if key is not None else self.r

    def alpha_of(self, name: str) -> float:
        key = _pattern_key(self.alpha_pattern, name)
        return float(self.alpha_pattern[key]) if key is not None else self.lora_alpha

    def scale_of(self, name: str) -> float:
        """The factor on B·A: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        rank, alpha = self.rank_of(name), self.alpha_of(name)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def targeted(self, base: BaseShape) -> list[tuple[int, str]]:
        """Every (layer, short module name) this config adapts in `base`, in layer order."""
        return [
            (layer, module)
            for layer in range(base.num_layers)
            for module in MODULES
            if self.targets(module_name(layer, module))
        ]


def _pattern_key(patterns: dict[str, Any], name: str) -> str | None:
    # PEFT's rule: the first pattern that matches the end of the module name, on a dot boundary.
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", name):
            return key
    return None


def read_config(directory: Path) -> LoraConfig:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"{CONFIG_FILE} is missing: a PEFT adapter directory needs it")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object")
    return parse_config(raw)


def parse_config(raw: dict[str, Any]) -> LoraConfig:
    """Validate the fields we serve and refuse, naming the field, the ones we do not."""
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"peft_type {peft_type!r} is not supported: only LORA adapters are served")
    _refuse_if(raw.get("use_dora"), "use_dora", "DoRA adapters are not supported")
    _refuse_if(raw.get("modules_to_save"), "modules_to_save", "fully trained extra modules are not supported")
    bias = raw.get("bias", "none")
    _refuse_if(bias not in (None, "none"), "bias", f"bias {bias!r} is not supported (only 'none')")
    _refuse_if(raw.get("lora_bias"), "lora_bias", "LoRA B biases are not supported")
    _refuse_if(raw.get("target_parameters"), "target_parameters", "targeting parameters is not supported")
    _refuse_if(
        raw.get("trainable_token_indices"), "trainable_token_indices", "trainable tokens are not supported"
    )
    _refuse_if(raw.get("layer_replication"), "layer_replication", "layer replication is not supported")
    _refuse_if(raw.get("layers_pattern"), "layers_pattern", "layers_pattern is not supported")

    r = _positive_int(raw.get("r", 8), "r")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
        raise AdapterError(f"lora_alpha must be a positive number, got {alpha!r}")
    targets = raw.get("target_modules")
    if targets is None or targets == [] or targets == "":
        raise AdapterError("target_modules is empty: the adapter must name the projections it adapts")
    target_modules: tuple[str, ...] | str
    if isinstance(targets, str):
        target_modules = tuple(_SHORT_NAMES) if targets == "all-linear" else targets
        if isinstance(target_modules, str):
            _check_regex(target_modules, "target_modules")
    elif isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        for target in targets:
            leaf = target.rsplit(".", 1)[-1]
            if leaf in _EMBEDDING_NAMES:
                raise AdapterError(
                    f"target_modules: {target!r} is an embedding; only projections are supported"
                )
            if leaf not in _SHORT_NAMES:
                raise AdapterError(
                    f"target_modules: {target!r} is not a supported projection; "
                    f"supported: {', '.join(_SHORT_NAMES)}"
                )
        target_modules = tuple(targets)
    else:
        raise AdapterError("target_modules must be a list of module names or one regular expression")

    layers = raw.get("layers_to_transform")
    layers_to_transform = None
    if layers is not None:
        layers_list = [layers] if isinstance(layers, int) else layers
        if not isinstance(layers_list, list) or not all(isinstance(i, int) and i >= 0 for i in layers_list):
            raise AdapterError("layers_to_transform must be a layer index or a list of them")
        layers_to_transform = tuple(layers_list)
    exclude = raw.get("exclude_modules")
    if isinstance(exclude, str):
        _check_regex(exclude, "exclude_modules")
    elif exclude is not None and not (isinstance(exclude, list) and all(isinstance(e, str) for e in exclude)):
        raise AdapterError("exclude_modules must be a list of module names or one regular expression")

    rank_pattern = _pattern(raw.get("rank_pattern"), "rank_pattern", integer=True)
    alpha_pattern = _pattern(raw.get("alpha_pattern"), "alpha_pattern", integer=False)
    return LoraConfig(
        r=r,
        lora_alpha=float(alpha),
        use_rslora=bool(raw.get("use_rslora", False)),
        target_modules=target_modules,
        layers_to_transform=layers_to_transform,
        exclude_modules=tuple(exclude) if isinstance(exclude, list) else exclude,
        rank_pattern={k: int(v) for k, v in rank_pattern.items()},
        alpha_pattern={k: float(v) for k, v in alpha_pattern.items()},
        # PEFT turns this off itself for the nn.Linear layers of Llama models; A and B keep their shapes.
        fan_in_fan_out=bool(raw.get("fan_in_fan_out", False)),
        base_model_name_or_path=raw.get("base_model_name_or_path"),
    )


def _refuse_if(condition: Any, name: str, reason: str) -> None:
    if condition:
        raise AdapterError(f"{name}: {reason}")


def _positive_int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise AdapterError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_regex(pattern: str, name: str) -> None:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise AdapterError(f"{name}: {pattern!r} is not a valid regular expression ({exc})") from exc


def _pattern(value: Any, name: str, integer: bool) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise AdapterError(f"{name} must map module patterns to values")
    for key, item in value.items():
        _check_regex(key, f"{name} key")
        if integer:
            _positive_int(item, f"{name}[{key!r}]")
        elif not isinstance(item, int | float) or isinstance(item, bool) or item <= 0:
            raise AdapterError(f"{name}[{key!r}] must be a positive number, got {item!r}")
    return value
