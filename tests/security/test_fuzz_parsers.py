"""Fuzzing the two parsers a tenant's bytes reach: adapter_config.json and the safetensors header.

Whatever the bytes, the answer is a valid result or an AdapterError, never another exception (a 500), and
each example answers within the deadline. LORAPLEX_FUZZ_EXAMPLES sets the examples per test (150 by
default, so the file takes seconds in `make test`); docs/security.md, "Fuzzing", records a longer run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from loraplex.adapters import AdapterError, LoraConfig, inspect_adapter
from loraplex.adapters.peft_config import parse_config_bytes
from loraplex.adapters.safetensors_header import DTYPE_BYTES, read_header
from loraplex.adapters.shapes import MODULES, module_name
from loraplex.adapters.weights import check_finite

from .adapter_files import CONFIG, TINY_SHAPE, WEIGHTS, config_dict, lora_tensors, tensor_name, weights_bytes

EXAMPLES = int(os.environ.get("LORAPLEX_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    # Generous for a shared CI machine, yet minutes short of what a catastrophic regex or a quadratic
    # parse costs: an example over it fails the test.
    deadline=timedelta(seconds=5),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
NAMES = [module_name(layer, module) for layer in range(TINY_SHAPE.num_layers) for module in MODULES]

# JSON values as a tenant could write them: every type, non-finite floats, integers of any size.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=20), children, max_size=5)
    ),
    max_leaves=20,
)
# Regexes built from the characters that make regexes interesting, and module-name-like words.
regex_text = st.text(alphabet=list("._*+?|()[]{}^$\\dws0123456789,-=!<>:aqkvoprxyz_"), max_size=30)
module_words = st.sampled_from(
    [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "self_attn.q_proj",
        "lm_head",
    ]
)
config_fields = {
    "peft_type": st.sampled_from(["LORA", "lora", "IA3"]) | json_values,
    "r": st.integers(min_value=-2, max_value=20) | json_values,
    "lora_alpha": st.floats(allow_nan=True, allow_infinity=True) | st.integers(-5, 64) | json_values,
    "target_modules": st.lists(module_words, max_size=4) | regex_text | json_values,
    "exclude_modules": st.none() | st.lists(module_words, max_size=3) | regex_text | json_values,
    "layers_to_transform": st.none()
    | st.integers(-1, 3)
    | st.lists(st.integers(-1, 3), max_size=3)
    | json_values,
    "rank_pattern": st.dictionaries(regex_text | module_words, st.integers(-1, 20) | json_values, max_size=3),
    "alpha_pattern": st.dictionaries(regex_text | module_words, st.floats() | json_values, max_size=3),
    "use_rslora": st.booleans() | json_values,
    "bias": st.sampled_from(["none", "all"]) | json_values,
}
projections = st.sampled_from(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
valid_fields = {
    "r": st.integers(1, 16),
    "lora_alpha": st.integers(1, 64) | st.floats(0.01, 100),
    "target_modules": st.lists(projections, min_size=1, max_size=4) | regex_text,
    "exclude_modules": st.none() | st.lists(projections, max_size=2) | regex_text,
    "layers_to_transform": st.none() | st.lists(st.integers(0, 3), max_size=3),
    "rank_pattern": st.dictionaries(regex_text | projections, st.integers(1, 16), max_size=3),
    "alpha_pattern": st.dictionaries(regex_text | projections, st.floats(0.1, 64), max_size=3),
    "use_rslora": st.booleans(),
}
# A plausible config with up to two fields made hostile and a few unknown keys: valid configs are reached
# (so matching and scales are exercised), and so is every field's refusal.
hostile_field = st.sampled_from(list(config_fields)).flatmap(
    lambda key: config_fields[key].map(lambda v: (key, v))
)
configs = st.builds(
    lambda base, hostile, extra: extra | base | dict(hostile),
    st.fixed_dictionaries({}, optional=valid_fields),
    st.lists(hostile_field, max_size=2),
    st.dictionaries(st.text(max_size=10), json_values, max_size=2),
)


def parse_and_exercise(data: bytes) -> None:
    """parse_config_bytes, then every question asked of a config; the outcome is counted (hypothesis
    statistics), so a run shows that valid configs are reached, not only refusals."""
    try:
        config = parse_config_bytes(data)
    except AdapterError:
        event("refused")
        return
    event("accepted")
    exercise(config)


def exercise(config: LoraConfig) -> None:
    """Everything the engine and control plane ask of a parsed config, on every projection's name."""
    config.targeted(TINY_SHAPE)
    for name in NAMES:
        config.targets(name)
        assert config.scale_of(name) > 0


@FUZZ
@given(data=st.binary(max_size=2048))
def test_any_bytes_as_a_config(data: bytes) -> None:
    parse_and_exercise(data)


@FUZZ
@given(config=configs)
def test_any_json_config(config: dict[str, Any]) -> None:
    parse_and_exercise(json.dumps(config).encode())


# Tokens Python's json accepts but a config must not hold, spliced anywhere.
NASTY = [b"NaN", b"-Infinity", b"1e999", b"9" * 5000, b"[" * 3000, b'"\\ud800"', b'"\\u0000"', b'"r": 3, "r"']


@FUZZ
@given(config=configs, cut=st.integers(0, 400), junk=st.binary(max_size=8) | st.sampled_from(NASTY))
def test_damaged_json_config(config: dict[str, Any], cut: int, junk: bytes) -> None:
    text = json.dumps(config).encode()
    parse_and_exercise(text[:cut] + junk + text[cut:])


NASTY_VALUES = ["NaN", "-Infinity", "1e999", "9" * 5000, "[" * 3000 + "]" * 3000, '"\\ud800"', '"a\\u0000"']


@FUZZ
@given(
    config=configs,
    field=st.sampled_from([*config_fields, "loftq_config"]),
    token=st.sampled_from(NASTY_VALUES),
    nested=st.booleans(),
)
def test_nasty_values_in_any_field(config: dict[str, Any], field: str, token: str, nested: bool) -> None:
    marker = "@@nasty@@"
    value: Any = {"q_proj": marker} if nested else marker
    text = json.dumps({**config, field: value}).replace(f'"{marker}"', token)
    with pytest.raises(AdapterError):  # whichever field holds it, and whatever else is wrong
        parse_config_bytes(text.encode())


def check_header(path: Path) -> None:
    """read_header on `path`: an AdapterError, or tensors that tile the file's data section exactly."""
    try:
        tensors = read_header(path)
    except AdapterError:
        event("refused")
        return
    event("accepted")
    size = path.stat().st_size
    position = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    for info in tensors.values():
        assert info.begin == position and info.end - info.begin >= 0
        position = info.end
    assert position == size
    with contextlib.suppress(AdapterError):
        check_finite(path, tensors)


@FUZZ
@given(data=st.binary(max_size=2048))
def test_any_bytes_as_a_safetensors_file(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / WEIGHTS
    path.write_bytes(data)
    check_header(path)


entry_fields = {
    "dtype": st.sampled_from([*DTYPE_BYTES, "F8_E4M3", ""]) | json_values,
    "shape": st.lists(st.integers(-1, 6), max_size=3) | json_values,
    "data_offsets": st.lists(st.integers(-1, 80), min_size=2, max_size=2) | json_values,
}
# Mostly entries with all three fields, so that each field's own check is reached with hostile values.
entries = st.fixed_dictionaries(entry_fields) | st.fixed_dictionaries({}, optional=entry_fields)
headers = st.dictionaries(
    st.sampled_from([tensor_name(0, "q_proj", "A"), "__metadata__", "a", "b"]) | st.text(max_size=12),
    entries | json_values,
    max_size=4,
)


@FUZZ
@given(header=headers, data=st.binary(max_size=96), length_error=st.sampled_from([0, 0, 0, -1, 1, 2**40]))
def test_any_json_header(tmp_path: Path, header: dict[str, Any], data: bytes, length_error: int) -> None:
    raw = json.dumps(header).encode()
    path = tmp_path / WEIGHTS
    path.write_bytes(struct.pack("<Q", max(0, len(raw) + length_error)) + raw + data)
    check_header(path)


tensor_specs = st.lists(
    st.tuples(
        st.text(min_size=1, max_size=12),
        st.sampled_from(list(DTYPE_BYTES)),
        st.lists(st.integers(0, 4), max_size=3),
    ),
    max_size=5,
    unique_by=lambda spec: spec[0],
)
# A field replaced by any JSON value, a tensor renamed, or a tensor's byte range moved by a few bytes (same
# length, so only the tiling check can see the overlap or the gap).
flaws = (
    st.none()
    | st.tuples(st.integers(0, 4), st.sampled_from([*entry_fields, "name"]), json_values)
    | st.tuples(st.integers(0, 4), st.just("shift"), st.integers(-8, 8))
)


@FUZZ
@given(specs=tensor_specs, flaw=flaws, order=st.randoms(), data=st.data())
def test_consistent_header_with_at_most_one_flaw(
    tmp_path: Path, specs: list[tuple[str, str, list[int]]], flaw: Any, order: Any, data: Any
) -> None:
    # Valid headers (in any key order) with random tensor bytes, one field sometimes replaced: the tiling
    # and finite checks run on accepted headers, each field's check on the flawed one.
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape in specs:
        size = DTYPE_BYTES[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    if flaw is not None and specs:
        index, field, value = flaw
        name = specs[index % len(specs)][0]
        if field == "name":
            header[str(value)] = header.pop(name)
        elif field == "shift":
            header[name]["data_offsets"] = [max(0, o + value) for o in header[name]["data_offsets"]]
        else:
            header[name][field] = value
    items = list(header.items())
    order.shuffle(items)
    raw = json.dumps(dict(items)).encode()
    path = tmp_path / WEIGHTS
    path.write_bytes(
        struct.pack("<Q", len(raw)) + raw + data.draw(st.binary(min_size=offset, max_size=offset))
    )
    check_header(path)


VALID_WEIGHTS = weights_bytes(lora_tensors(rank=1), "F16")


@FUZZ
@given(
    edits=st.lists(
        st.tuples(st.integers(0, len(VALID_WEIGHTS) - 1), st.integers(0, 3), st.binary(max_size=4)),
        max_size=4,
    )
)
def test_damaged_valid_adapter(tmp_path: Path, edits: list[tuple[int, int, bytes]]) -> None:
    # Byte edits of a real adapter's weights (most land in the header): inspect_adapter, end to end.
    weights = VALID_WEIGHTS
    for position, removed, inserted in edits:
        weights = weights[:position] + inserted + weights[position + removed :]
    directory = tmp_path / "adapter"
    directory.mkdir(exist_ok=True)
    (directory / CONFIG).write_text(json.dumps(config_dict(rank=1)))
    (directory / WEIGHTS).write_bytes(weights)
    try:
        manifest = inspect_adapter(directory, TINY_SHAPE)
    except AdapterError:
        event("refused")
        return
    event("accepted")
    assert len(manifest.modules) == 4
