"""adapter_config.json: parse a PEFT LoRA config and refuse, by field, what loraplex does not serve."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import re2

from .errors import AdapterError
from .shapes import MODULE_PATHS, MODULES, BaseShape, module_name
from .strict_json import loads_strict, shown

CONFIG_FILE = "adapter_config.json"

# PEFT writes configs of about a kilobyte, nested three levels at most (loftq_config, eva_config).
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 8
# Every pattern and module name below is the tenant's; these bound the work one config can ask for.
MAX_PATTERN_CHARS = 512
MAX_PATTERNS = 64  # entries of target_modules / exclude_modules lists, keys of rank_pattern / alpha_pattern
MAX_RANK = 16384
# A scale beyond this overflows half-precision activations; no trained adapter comes near it.
MAX_ALPHA = 1e6
MAX_LAYER = 100_000
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a tenant's bad pattern is an AdapterError, not a line on stderr
_RE2_OPTIONS.max_mem = 1 << 20  # bounds each compiled program and its match cache: time and memory

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
    # DoRA: each adapted module also has a magnitude vector m [out]; its output is scaled per channel
    # by m / ||W0 + scale * B A|| (the engine computes that once, at load, against its base weights).
    use_dora: bool = False

    def targets(self, name: str) -> bool:
        """Whether PEFT would wrap the module `name` (e.g. model.layers.3.self_attn.q_proj).

        PEFT's check_target_module_exists: a string is a regex that must match the whole name; a list
        matches a name exactly or as a dotted suffix, and only a suffix match is filtered by layer.
        """
        if self.exclude_modules:
            if isinstance(self.exclude_modules, str):
                if compile_pattern(self.exclude_modules).fullmatch(name):
                    return False
            elif any(name == m or name.endswith(f".{m}") for m in self.exclude_modules):
                return False
        if isinstance(self.target_modules, str):
            return compile_pattern(self.target_modules).fullmatch(name) is not None
        if name in self.target_modules:
            return True
        found = any(name.endswith(f".{t}") for t in self.target_modules)
        if found and self.layers_to_transform is not None:
            layer = int(name.split(".")[2])  # our own module_name(), never the tenant's text
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
    # PEFT's get_pattern_key: the first key whose regex matches the end of the name on a dot boundary,
    # built by pasting the key into a larger regex exactly as PEFT does (so a key may hold `|` or groups).
    for key in patterns:
        if compile_pattern(_suffix_pattern(key)).match(name):
            return key
    return None


def _suffix_pattern(key: str) -> str:
    return rf"(.*\.)?({key})$"


@functools.lru_cache(maxsize=256)  # at most 256 MiB even if every entry used all of max_mem
def compile_pattern(pattern: str) -> re2._Regexp:
    """A tenant's regex compiled by RE2: matching time is linear in the name, whatever the pattern.

    Raises re2.error for what RE2 does not accept (backreferences, lookaround) or cannot fit in memory.
    """
    return re2.compile(pattern, _RE2_OPTIONS)


def read_config(directory: Path) -> LoraConfig:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"{CONFIG_FILE} is missing: a PEFT adapter directory needs it")
    with path.open("rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise AdapterError(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes; PEFT configs are ~1 KB")
    return parse_config_bytes(data)


def parse_config_bytes(data: bytes) -> LoraConfig:
    """The bytes of an adapter_config.json to a LoraConfig, or an AdapterError naming the field."""
    raw = loads_strict(data, CONFIG_FILE, MAX_CONFIG_DEPTH)
    if not isinstance(raw, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object")
    try:
        return parse_config(raw)
    except AdapterError as exc:
        raise AdapterError(f"{CONFIG_FILE}: {exc}") from None


def parse_config(raw: dict[str, Any]) -> LoraConfig:
    """Validate the fields we serve and refuse, naming the field, the ones we do not."""
    peft_type = raw.get("peft_type", "LORA")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise AdapterError(f"peft_type {shown(peft_type)} is not supported: only LORA adapters are served")
    _refuse_if(raw.get("modules_to_save"), "modules_to_save", "fully trained extra modules are not supported")
    bias = raw.get("bias", "none")
    _refuse_if(bias not in (None, "none"), "bias", f"bias {shown(bias)} is not supported (only 'none')")
    _refuse_if(raw.get("lora_bias"), "lora_bias", "LoRA B biases are not supported")
    _refuse_if(raw.get("target_parameters"), "target_parameters", "targeting parameters is not supported")
    _refuse_if(
        raw.get("trainable_token_indices"), "trainable_token_indices", "trainable tokens are not supported"
    )
    _refuse_if(raw.get("layer_replication"), "layer_replication", "layer replication is not supported")
    _refuse_if(raw.get("layers_pattern"), "layers_pattern", "layers_pattern is not supported")

    base_model = raw.get("base_model_name_or_path")
    if base_model is not None and not (isinstance(base_model, str) and len(base_model) <= 1024):
        raise AdapterError("base_model_name_or_path must be a string of at most 1024 characters")
    return LoraConfig(
        r=_rank(raw.get("r", 8), "r"),
        lora_alpha=_alpha(raw.get("lora_alpha", 8), "lora_alpha"),
        use_rslora=_flag(raw, "use_rslora"),
        target_modules=_target_modules(raw.get("target_modules")),
        layers_to_transform=_layers(raw.get("layers_to_transform")),
        exclude_modules=_exclude_modules(raw.get("exclude_modules")),
        rank_pattern={k: _rank(v, f"rank_pattern[{shown(k)}]") for k, v in _patterns(raw, "rank_pattern")},
        alpha_pattern={
            k: _alpha(v, f"alpha_pattern[{shown(k)}]") for k, v in _patterns(raw, "alpha_pattern")
        },
        # PEFT turns this off itself for the nn.Linear layers of Llama models; A and B keep their shapes.
        fan_in_fan_out=_flag(raw, "fan_in_fan_out"),
        base_model_name_or_path=base_model,
        use_dora=_flag(raw, "use_dora"),
    )


def _refuse_if(condition: Any, name: str, reason: str) -> None:
    if condition:
        raise AdapterError(f"{name}: {reason}")


def _flag(raw: dict[str, Any], name: str) -> bool:
    value = raw.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):  # "false" is a truthy string: refuse rather than guess
        raise AdapterError(f"{name} must be true or false, got {shown(value)}")
    return value


def _rank(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_RANK:
        raise AdapterError(f"{name} must be a positive integer of at most {MAX_RANK}, got {shown(value)}")
    return value


def _alpha(value: Any, name: str) -> float:
    # loads_strict already refused NaN and infinities; a number here is finite.
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise AdapterError(f"{name} must be a finite number, got {shown(value)}")
    if not (math.isfinite(value) and 0 < value <= MAX_ALPHA):
        raise AdapterError(f"{name} must be a finite number in (0, {MAX_ALPHA:g}], got {shown(value)}")
    return float(value)


def _target_modules(targets: Any) -> tuple[str, ...] | str:
    if targets is None or targets == [] or targets == "":
        raise AdapterError("target_modules is empty: the adapter must name the projections it adapts")
    if isinstance(targets, str):
        if targets == "all-linear":
            return tuple(_SHORT_NAMES)
        _check_regex(targets, "target_modules")
        return targets
    names = _names(targets, "target_modules")
    for target in names:
        leaf = target.rsplit(".", 1)[-1]
        if leaf in _EMBEDDING_NAMES:
            raise AdapterError(
                f"target_modules: {shown(target)} is an embedding; only projections are supported"
            )
        if leaf not in _SHORT_NAMES:
            raise AdapterError(
                f"target_modules: {shown(target)} is not a supported projection; "
                f"supported: {', '.join(_SHORT_NAMES)}"
            )
    return names


def _exclude_modules(exclude: Any) -> tuple[str, ...] | str | None:
    if exclude is None:
        return None
    if isinstance(exclude, str):
        _check_regex(exclude, "exclude_modules")
        return exclude
    return _names(exclude, "exclude_modules")


def _names(value: Any, name: str) -> tuple[str, ...]:
    """A list of module names (matched as dotted suffixes, never as regexes)."""
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise AdapterError(f"{name} must be a list of module names or one regular expression")
    if len(value) > MAX_PATTERNS:
        raise AdapterError(f"{name} lists {len(value)} modules; at most {MAX_PATTERNS} are allowed")
    for item in value:
        if len(item) > MAX_PATTERN_CHARS:
            raise AdapterError(f"{name}: a module name is longer than {MAX_PATTERN_CHARS} characters")
    return tuple(value)


def _layers(layers: Any) -> tuple[int, ...] | None:
    if layers is None:
        return None
    layers_list = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
    if not isinstance(layers_list, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_LAYER for i in layers_list
    ):
        raise AdapterError(f"layers_to_transform must be a layer index (0 to {MAX_LAYER}) or a list of them")
    # PEFT reads an empty list as "every layer".
    return tuple(sorted(set(layers_list))) if layers_list else None


def _check_regex(pattern: str, name: str) -> None:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise AdapterError(f"{name}: the regular expression is longer than {MAX_PATTERN_CHARS} characters")
    try:
        compile_pattern(pattern)
    except re2.error as exc:
        reason = (
            exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        )
        raise AdapterError(
            f"{name}: {shown(pattern)} is not a regular expression RE2 accepts ({reason}); loraplex matches "
            "patterns in linear time, without lookarounds or backreferences"
        ) from None


def _patterns(raw: dict[str, Any], name: str) -> list[tuple[str, Any]]:
    value = raw.get(name)
    if value is None:
        return []
    if not isinstance(value, dict):
        raise AdapterError(f"{name} must map module patterns to values")
    if len(value) > MAX_PATTERNS:
        raise AdapterError(f"{name} has {len(value)} patterns; at most {MAX_PATTERNS} are allowed")
    for key in value:
        if len(key) > MAX_PATTERN_CHARS:
            raise AdapterError(f"{name}: a pattern is longer than {MAX_PATTERN_CHARS} characters")
        # The key is matched pasted into PEFT's suffix regex, so that whole regex is what must compile.
        _check_regex(_suffix_pattern(key), f"{name} key {shown(key)}")
    return list(value.items())
