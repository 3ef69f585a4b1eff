"""Adapter contents a tenant controls cannot crash, freeze or poison the control plane or the engine
(issue 14, items 1 upload side, 3 and 6).

Each attack is reproduced as it was found; each test asserts the refusal (an AdapterError naming the file
and field, a 422 through the tenant API) or the bound on time or memory.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from loraplex.adapters import AdapterError, LoraConfig, inspect_adapter, parse_config
from loraplex.adapters.peft_config import MAX_PATTERNS
from loraplex.adapters.safetensors_header import MAX_HEADER_BYTES, MAX_TENSORS, read_header
from loraplex.adapters.shapes import MODULES, module_name
from loraplex.adapters.weights import CHUNK_BYTES, check_finite
from tests.web.conftest import (  # noqa: F401  (fixtures)
    SHAPE,
    Api,
    app_factory,
    sqlite_template,
    sqlite_url,
    upload,
)

from .adapter_files import (
    CONFIG,
    TINY_SHAPE,
    WEIGHTS,
    config_dict,
    encode,
    lora_tensors,
    safetensors_bytes,
    tensor_name,
    weights_bytes,
    write_adapter,
)

# The catastrophic pattern of the issue: with Python's re, matching it against one 31-character module name
# takes 2**31 steps (minutes); RE2 answers in microseconds.
CATASTROPHIC = "(.|.)*Z"


def refused(directory: Path, match: str) -> str:
    with pytest.raises(AdapterError, match=match) as caught:
        inspect_adapter(directory, TINY_SHAPE)
    return str(caught.value)


def test_the_valid_adapter_these_tests_damage_is_accepted(tmp_path: Path) -> None:
    manifest = inspect_adapter(write_adapter(tmp_path / "a"), TINY_SHAPE)
    assert {(m.layer, m.module) for m in manifest.modules} == {(0, "q"), (0, "v"), (1, "q"), (1, "v")}
    assert all(m.scale == 2.0 for m in manifest.modules)


# --- adapter_config.json: numbers -------------------------------------------------------------------


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_lora_alpha_is_refused_naming_the_field(tmp_path: Path, literal: str) -> None:
    text = json.dumps(config_dict()).replace('"lora_alpha": 4', f'"lora_alpha": {literal}')
    message = refused(write_adapter(tmp_path / "a", text), "lora_alpha must be a finite number")
    shown = "inf" if literal == "1e999" else literal
    assert message == f"adapter_config.json: lora_alpha must be a finite number, got {shown}"


def test_non_finite_number_anywhere_in_the_config_is_refused(tmp_path: Path) -> None:
    text = json.dumps({**config_dict(), "alpha_pattern": {"q_proj": 8}}).replace(
        '"q_proj": 8', '"q_proj": NaN'
    )
    refused(write_adapter(tmp_path / "a", text), r"alpha_pattern\.q_proj must be a finite number, got NaN")
    unused = json.dumps({**config_dict(), "loftq_config": {"x": [1, 2]}}).replace("2]", "-Infinity]")
    refused(write_adapter(tmp_path / "b", unused), r"loftq_config\.x\[1\] must be a finite number")


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"lora_alpha": 1e300}, r"lora_alpha must be a finite number in \(0, 1e\+06\]"),
        ({"lora_alpha": True}, "lora_alpha must be a finite number, got True"),
        ({"r": 2**40}, "r must be a positive integer of at most 16384"),
        ({"use_rslora": "false"}, "use_rslora must be true or false"),
        ({"layers_to_transform": [True]}, "layers_to_transform must be a layer index"),
        ({"layers_to_transform": [10**9]}, "layers_to_transform must be a layer index"),
        ({"peft_type": ["LORA"]}, r"peft_type \['LORA'\] is not supported"),
        ({"base_model_name_or_path": "x" * 2000}, "base_model_name_or_path must be a string"),
        ({"rank_pattern": {"q_proj": 1.5}}, r"rank_pattern\['q_proj'\] must be a positive integer"),
    ],
)
def test_config_values_of_the_wrong_type_or_range_are_refused(
    tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    refused(write_adapter(tmp_path / "a", {**config_dict(), **changes}), f"adapter_config.json: {message}")


def test_integer_with_thousands_of_digits_is_refused_before_int(tmp_path: Path) -> None:
    # json.loads itself raises a bare ValueError past 4300 digits: that was a 500.
    text = json.dumps(config_dict()).replace('"r": 2', '"r": 1' + "0" * 5000)
    refused(write_adapter(tmp_path / "a", text), "an integer of 5001 digits is out of range")


def test_duplicate_config_keys_are_refused(tmp_path: Path) -> None:
    # json.loads keeps the last "r"; a reader that keeps the first would serve another rank.
    text = json.dumps(config_dict()).replace('"r": 2', '"r": 2, "r": 64')
    refused(write_adapter(tmp_path / "a", text), "adapter_config.json: key 'r' appears twice")


def test_deeply_nested_config_is_refused_without_recursing(tmp_path: Path) -> None:
    depth = 200_000  # json.loads would raise RecursionError (a 500) long before this
    text = json.dumps(config_dict())[:-1] + ', "x": ' + "[" * depth + "]" * depth + "}"
    refused(write_adapter(tmp_path / "a", text), f"nests {depth + 1} levels deep; at most 8")


@pytest.mark.parametrize(
    "text,message",
    [
        ('{"r": 2, "a\\u0000": 1}', r"a\\x00 holds a NUL character"),
        ('{"base_model_name_or_path": "\\ud800"}', "holds an unpaired surrogate"),
        ("[1, 2]", "must hold a JSON object"),
        ('{"r": 2', "is not valid JSON"),
    ],
)
def test_config_strings_no_database_can_hold_are_refused(tmp_path: Path, text: str, message: str) -> None:
    refused(write_adapter(tmp_path / "a", text), message)


def test_oversized_config_is_refused_before_parsing(tmp_path: Path) -> None:
    text = json.dumps({**config_dict(), "padding": "x" * (1 << 20)})
    refused(write_adapter(tmp_path / "a", text), "adapter_config.json is larger than 1048576 bytes")
    (tmp_path / "a" / CONFIG).write_bytes(b"\xff\xfe{}")
    refused(tmp_path / "a", "adapter_config.json is not UTF-8 text")


# --- adapter_config.json: patterns ------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {"target_modules": CATASTROPHIC},
        {"exclude_modules": CATASTROPHIC},
        {"rank_pattern": {CATASTROPHIC: 4}},
        {"alpha_pattern": {CATASTROPHIC: 4, "(a|aa)*$": 2}},
    ],
)
def test_catastrophic_patterns_match_in_linear_time(tmp_path: Path, changes: dict[str, Any]) -> None:
    directory = write_adapter(tmp_path / "a", {**config_dict(), **changes})
    start = time.perf_counter()
    try:
        inspect_adapter(directory, TINY_SHAPE)
    except AdapterError as exc:  # (.|.)*Z as target_modules matches nothing: a clean refusal is fine
        assert "target_modules matches none" in str(exc)
    assert time.perf_counter() - start < 2.0


def test_a_long_name_against_a_catastrophic_pattern_stays_fast() -> None:
    config = parse_config({"r": 2, "target_modules": CATASTROPHIC, "rank_pattern": {CATASTROPHIC: 4}})
    name = "model.layers.1." + "x" * 100_000
    start = time.perf_counter()
    assert not config.targets(name) and config.rank_of(name) == 2
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"target_modules": r"(?=.*q_proj).*"}, "is not a regular expression RE2 accepts"),
        ({"exclude_modules": r"(q)_proj\1"}, "exclude_modules: .* is not a regular expression RE2 accepts"),
        ({"rank_pattern": {"q(?!x)": 4}}, "rank_pattern key 'q\\(\\?!x\\)'"),
        ({"target_modules": "a{1000}{1000}"}, "is not a regular expression RE2 accepts"),
        ({"target_modules": "q" * 513}, "target_modules: the regular expression is longer than 512"),
        ({"rank_pattern": {"q" * 513: 4}}, "rank_pattern: a pattern is longer than 512"),
        ({"alpha_pattern": {f"p{i}": 2 for i in range(MAX_PATTERNS + 1)}}, "alpha_pattern has 65 patterns"),
        ({"target_modules": ["q_proj"] * (MAX_PATTERNS + 1)}, "target_modules lists 65 modules"),
        ({"exclude_modules": ["k" * 600]}, "exclude_modules: a module name is longer than 512"),
    ],
)
def test_patterns_re2_cannot_run_or_too_many_are_refused(
    tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    refused(write_adapter(tmp_path / "a", {**config_dict(), **changes}), message)


# PEFT's own matching is the oracle: loraplex must wrap exactly the modules PEFT wraps, at the same ranks.
PEFT_CASES: list[dict[str, Any]] = [
    {"target_modules": r".*\.(q_proj|v_proj)"},
    {"target_modules": r"model\.layers\.[13]\.mlp\..*"},
    {"target_modules": "q_proj"},  # a string is a full-match regex: matches no full name
    {"target_modules": ["q_proj", "model.layers.2.mlp.down_proj"], "layers_to_transform": [1]},
    {"target_modules": ["self_attn.k_proj", "up_proj"], "layers_to_transform": 3},
    {"target_modules": ["q_proj", "v_proj"], "layers_to_transform": []},
    {
        "target_modules": ["q_proj", "o_proj", "gate_proj"],
        "exclude_modules": ["model.layers.0.self_attn.q_proj"],
    },
    {"target_modules": r".*_proj", "exclude_modules": r".*\.[02]\.mlp\..*"},
    {"target_modules": ["down_proj", "v_proj"], "exclude_modules": ["v_proj"]},
    {
        "target_modules": r".*",
        "rank_pattern": {"q_proj": 4, r"layers\.1\.self_attn\.(k|v)_proj": 16, "a)|(.*mlp.*": 3},
        "alpha_pattern": {r"mlp\.(up|down)_proj": 32, "o_proj": 2},
    },
    {"target_modules": r".*", "rank_pattern": {r"\d\.self_attn\.q_proj": 6, "proj": 5, "_proj": 7}},
]


@pytest.mark.parametrize("case", PEFT_CASES)
def test_matching_is_exactly_peft_s(case: dict[str, Any]) -> None:
    from peft import LoraConfig as PeftLoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.other import get_pattern_key

    ours: LoraConfig = parse_config({"r": 8, "lora_alpha": 8, **case})
    theirs = PeftLoraConfig(r=8, lora_alpha=8, **case)
    for layer in range(4):
        for module in MODULES:
            name = module_name(layer, module)
            # PEFT answers a Match, True, False, None or an excluded marker that is falsy.
            assert ours.targets(name) == bool(check_target_module_exists(theirs, name)), name
            ranks, alphas = theirs.rank_pattern or {}, theirs.alpha_pattern or {}
            assert ours.rank_of(name) == ranks.get(get_pattern_key(list(ranks), name), theirs.r), name
            assert ours.alpha_of(name) == alphas.get(
                get_pattern_key(list(alphas), name), theirs.lora_alpha
            ), name


# --- adapter_model.safetensors: the header ----------------------------------------------------------

GOOD = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
DATA = np.zeros(4, dtype="<f4").tobytes()


@pytest.mark.parametrize(
    "header,data,message",
    [
        ({"t": {**GOOD, "shape": "2,2"}}, DATA, "shape must be a list of at most 8 non-negative integers"),
        ({"t": {**GOOD, "shape": [2, -2]}}, DATA, "shape must be a list"),
        ({"t": {**GOOD, "shape": [True, 4]}}, DATA, "shape must be a list"),
        ({"t": {**GOOD, "shape": [1] * 9}}, DATA, "shape must be a list of at most 8"),
        (
            {"t": {**GOOD, "data_offsets": ["0", "16"]}},
            DATA,
            "data_offsets must be two non-negative integers",
        ),
        ({"t": {**GOOD, "data_offsets": [0, 8, 16]}}, DATA, "data_offsets must be two"),
        ({"t": {**GOOD, "data_offsets": [16, 0]}}, DATA, r"data_offsets \[16, 0\] fall outside"),
        ({"t": {**GOOD, "data_offsets": [0, 32]}}, DATA * 2, "span 32 bytes, its shape"),
        (
            {"t": {**GOOD, "data_offsets": [16, 32]}},
            DATA,
            r"\[16, 32\] fall outside the 16-byte data section",
        ),
        ({"t": {**GOOD, "dtype": ["F32"]}}, DATA, r"dtype \['F32'\] is not one of"),
        ({"t": {**GOOD, "dtype": "F8_E4M3"}}, DATA, "dtype 'F8_E4M3' is not one of"),
        ({"t": {"dtype": "F32", "shape": [2, 2]}}, DATA, "must be an object with exactly dtype, shape"),
        ({"t": {**GOOD, "extra": 1}}, DATA, "must be an object with exactly dtype, shape"),
        ({"t": [1, 2]}, DATA, "must be an object with exactly"),
        ({"__metadata__": {"a": {"b": "c"}}, "t": GOOD}, DATA, "__metadata__ must map strings to strings"),
        ({"__metadata__": {"a": 1}, "t": GOOD}, DATA, "__metadata__ must map strings to strings"),
        ({"__metadata__": ["a"], "t": GOOD}, DATA, "__metadata__ must map strings to strings"),
        ({"": GOOD}, DATA, "a tensor name is empty or longer than 1024"),
        ({"t" * 1025: GOOD}, DATA, "a tensor name is empty or longer than 1024"),
        ({"t": {**GOOD, "shape": [1, 1], "data_offsets": [0, 4]}}, DATA, "12 bytes after the last tensor"),
        (
            {"a": GOOD, "b": GOOD},  # two names, one byte range: aliased weights
            DATA,
            "tensor 'b' at byte 0 overlaps the tensor before it",
        ),
        (
            {"a": {**GOOD, "shape": [1, 2], "data_offsets": [8, 16]}},
            DATA,
            "tensor 'a' at byte 8 leaves a gap before it",
        ),
        (
            {"a": {**GOOD, "data_offsets": [0, 16]}, "b": {**GOOD, "shape": [3], "data_offsets": [4, 16]}},
            DATA,
            "tensor 'b' at byte 4 overlaps",
        ),
        ({"t": {**GOOD, "shape": [2, 10**30]}}, DATA, "an integer of 31 digits is out of range"),
        ({"t": {**GOOD, "shape": [2, 2.0]}}, DATA, "shape must be a list"),
    ],
)
def test_malformed_headers_are_refused_naming_the_tensor_and_field(
    tmp_path: Path, header: dict[str, Any], data: bytes, message: str
) -> None:
    path = tmp_path / WEIGHTS
    path.write_bytes(safetensors_bytes(header, data))
    with pytest.raises(AdapterError, match=message) as caught:
        read_header(path)
    assert str(caught.value).startswith(WEIGHTS)


@pytest.mark.parametrize(
    "raw,message",
    [
        (b'{"t": ' * 50_000 + b"1" + b"}" * 50_000, "nests 50000 levels deep; at most 3"),
        (b'{"t": {"dtype": "F32", "shape": [[[2]]], "data_offsets": [0, 16]}}', "nests 5 levels"),
        (
            b'{"t": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 16]}}',
            r"t\.shape\[0\] must be a finite",
        ),
        (
            b'{"t": {"dtype": "F32", "dtype": "F16", "shape": [], "data_offsets": [0, 2]}}',
            "'dtype' appears twice",
        ),
        (b'{"t": {}, "t": {}}', "key 't' appears twice"),
        (b'{"t": "\xff"}', "header is not UTF-8 text"),
        (b"[]", r"corrupt safetensors header \(not an object\)"),
    ],
)
def test_hostile_header_json_is_refused_before_or_while_parsing(
    tmp_path: Path, raw: bytes, message: str
) -> None:
    path = tmp_path / WEIGHTS
    path.write_bytes(safetensors_bytes(raw, DATA))
    with pytest.raises(AdapterError, match=message):
        read_header(path)


def test_header_longer_than_the_file_or_the_limit_is_refused(tmp_path: Path) -> None:
    path = tmp_path / WEIGHTS
    path.write_bytes((100).to_bytes(8, "little") + b"{}")
    with pytest.raises(AdapterError, match="header length 100 is impossible"):
        read_header(path)
    path.write_bytes((MAX_HEADER_BYTES + 1).to_bytes(8, "little") + b" " * (MAX_HEADER_BYTES + 1))
    with pytest.raises(AdapterError, match=f"header length {MAX_HEADER_BYTES + 1} is impossible"):
        read_header(path)


def test_too_many_tensors_are_refused(tmp_path: Path) -> None:
    empty = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    path = tmp_path / WEIGHTS
    path.write_bytes(safetensors_bytes({f"t{i}": empty for i in range(MAX_TENSORS + 1)}))
    with pytest.raises(AdapterError, match=f"lists {MAX_TENSORS + 1} tensors; at most {MAX_TENSORS}"):
        read_header(path)


def test_offsets_are_absolute_and_in_file_order(tmp_path: Path) -> None:
    header = {"b": {**GOOD, "data_offsets": [16, 32]}, "a": GOOD}
    path = tmp_path / WEIGHTS
    path.write_bytes(safetensors_bytes(header, DATA * 2))
    start = 8 + len(json.dumps(header))
    tensors = read_header(path)
    assert list(tensors) == ["a", "b"]
    assert (tensors["a"].begin, tensors["a"].end, tensors["b"].begin) == (start, start + 16, start + 16)


# --- adapter_model.safetensors: names ---------------------------------------------------------------


def renamed(old: str, new: str) -> bytes:
    tensors = lora_tensors()
    return weights_bytes({(new if name == old else name): values for name, values in tensors.items()})


Q_A0 = tensor_name(0, "q_proj", "A")


@pytest.mark.parametrize(
    "new_name,message",
    [
        (
            "base_model.model.model.layers." + "9" * 5000 + ".self_attn.q_proj.lora_A.weight",
            "longer than 1024",
        ),
        (Q_A0.replace("layers.0", "layers.1234567"), "is not a LoRA A/B weight"),
        (Q_A0.replace("layers.0", "layers.00"), "is not a LoRA A/B weight"),
        (Q_A0.replace("layers.0", "layers.\u0660"), "is not a LoRA A/B weight"),  # ARABIC-INDIC DIGIT ZERO
        (Q_A0 + "\n", "is not a LoRA A/B weight"),
        (Q_A0.replace("q_proj", "q_pro\u0135"), "is not a LoRA A/B weight"),
    ],
)
def test_tensor_names_that_could_alias_or_overflow_are_refused(
    tmp_path: Path, new_name: str, message: str
) -> None:
    refused(write_adapter(tmp_path / "a", weights=renamed(Q_A0, new_name)), message)


def test_two_names_for_one_lora_weight_are_refused(tmp_path: Path) -> None:
    # Both spellings are the same weight to parse_tensor_name; the engine would load whichever came last.
    tensors = lora_tensors()
    tensors[Q_A0.removeprefix("base_model.model.")] = tensors[Q_A0] * 2
    message = refused(
        write_adapter(tmp_path / "a", weights=weights_bytes(tensors)), "are both layer 0 q lora_A"
    )
    assert Q_A0 in message


def test_duplicate_tensor_names_in_the_header_are_refused(tmp_path: Path) -> None:
    # json.loads keeps the last entry while another reader may take the first: the check must see both.
    raw = weights_bytes(lora_tensors())
    header_len = int.from_bytes(raw[:8], "little")
    header = raw[8 : 8 + header_len].decode()
    entry = header[header.index(f'"{Q_A0}"') :].split("}", 1)[0] + "}"
    doubled = header.replace(entry, f"{entry}, {entry}", 1).encode()
    weights = safetensors_bytes(doubled, raw[8 + header_len :])
    refused(write_adapter(tmp_path / "a", weights=weights), f"key '{Q_A0}' appears twice")


# --- adapter_model.safetensors: values --------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path: Path, dtype: str, bad: float) -> None:
    tensors = lora_tensors()
    name = tensor_name(1, "v_proj", "B")
    tensors[name][-1, -1] = bad  # the very last value of the file
    weights = weights_bytes(tensors, dtype)
    message = refused(write_adapter(tmp_path / "a", weights=weights), "holds NaN or infinite values")
    assert f"tensor {name} holds" in message


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_extreme_but_finite_weights_are_accepted(tmp_path: Path, dtype: str) -> None:
    tensors = lora_tensors()
    info = np.finfo(np.float16 if dtype == "F16" else np.float32)
    extremes = [float(info.max), -float(info.max), float(info.smallest_subnormal), -0.0, 0.0]
    if dtype == "BF16":  # the largest BF16 is F32's max with its low 16 bits cleared
        extremes[:2] = [3.3895313892515355e38, -3.3895313892515355e38]
    tensors[Q_A0][0, : len(extremes)] = extremes
    inspect_adapter(write_adapter(tmp_path / "a", weights=weights_bytes(tensors, dtype)), TINY_SHAPE)


def test_finite_check_streams_large_weights_in_bounded_memory(tmp_path: Path) -> None:
    # 96 MiB of weights, NaN in the last value: found, with a peak far below the file's size.
    count = 24 << 20
    values = np.zeros(count, dtype="<f4")
    values[-1] = np.nan
    header = {"big": {"dtype": "F32", "shape": [count], "data_offsets": [0, 4 * count]}}
    path = tmp_path / WEIGHTS
    path.write_bytes(safetensors_bytes(header, values.tobytes()))
    del values
    tracemalloc.start()
    try:
        with pytest.raises(AdapterError, match="tensor big holds NaN"):
            check_finite(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * CHUNK_BYTES, peak


def test_finite_check_reads_each_tensor_s_own_bytes(tmp_path: Path) -> None:
    # A NaN's bytes inside an integer tensor are not a float: only float tensors are checked, each by range.
    nan_bits = encode(np.array([np.nan], dtype="f4"), "F32")
    header = {
        "ints": {"dtype": "I32", "shape": [1], "data_offsets": [0, 4]},
        "floats": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    path = tmp_path / WEIGHTS
    path.write_bytes(safetensors_bytes(header, nan_bits + encode(np.array([1.0, 2.0]), "F32")))
    check_finite(path)
    path.write_bytes(safetensors_bytes(header, b"\x01\x00\x00\x00" + encode(np.array([1.0, np.nan]), "F32")))
    with pytest.raises(AdapterError, match="tensor floats holds NaN"):
        check_finite(path)


# --- through the tenant API: a 422 naming the problem, never a 500 ----------------------------------


@pytest.fixture
def client(sqlite_url: str, app_factory: Callable[..., FastAPI]) -> Iterator[TestClient]:  # noqa: F811
    app: FastAPI = app_factory(sqlite_url)
    with TestClient(app) as c:
        yield c


@pytest.fixture
def tenant(client: TestClient) -> dict[str, str]:
    api = Api(client)
    api.deployment("tiny", "tiny-llama", ["http://127.0.0.1:9"], shape=SHAPE)
    _, headers = api.tenant_with_key("acme")
    return headers


def adapter_files(directory: Path) -> list[tuple[str, bytes]]:
    return [(name, (directory / name).read_bytes()) for name in (CONFIG, WEIGHTS)]


def test_hostile_uploads_get_a_422_naming_the_field(
    client: TestClient, tenant: dict[str, str], tmp_path: Path
) -> None:
    nan_weights = lora_tensors()
    nan_weights[Q_A0][0, 0] = np.nan
    cases = {
        "nan-alpha": (
            write_adapter(
                tmp_path / "1", json.dumps(config_dict()).replace('"lora_alpha": 4', '"lora_alpha": NaN')
            ),
            "lora_alpha must be a finite number, got NaN",
        ),
        "redos": (
            write_adapter(tmp_path / "2", {**config_dict(), "exclude_modules": CATASTROPHIC}),
            None,  # accepted: nothing is excluded, and it answered at once
        ),
        "lookahead": (
            write_adapter(tmp_path / "3", {**config_dict(), "target_modules": "(?=q).*"}),
            "is not a regular expression RE2 accepts",
        ),
        "nan-weights": (
            write_adapter(tmp_path / "4", weights=weights_bytes(nan_weights, "BF16")),
            f"tensor {Q_A0} holds NaN or infinite values",
        ),
        "string-shape": (
            write_adapter(
                tmp_path / "5",
                weights=safetensors_bytes({Q_A0: {**GOOD, "shape": "2,2"}}, DATA),
            ),
            "shape must be a list",
        ),
        "deep-header": (
            write_adapter(tmp_path / "6", weights=safetensors_bytes(b"[" * 100_000 + b"]" * 100_000)),
            "nests 100000 levels deep",
        ),
    }
    for name, (directory, message) in cases.items():
        start = time.perf_counter()
        response = upload(client, tenant, adapter_files(directory), name=name)
        assert time.perf_counter() - start < 5.0, name
        if message is None:
            assert response.status_code == 201, response.text
            continue
        assert response.status_code == 422, (name, response.text)
        assert message in response.json()["detail"], (name, response.text)
    listed = {a["name"]: a for a in client.get("/api/v1/adapters", headers=tenant).json()}
    assert [name for name, a in listed.items() if a["status"] == "ready"] == ["redos"]
    for name, (_, message) in cases.items():  # a refused upload is kept failed, with the reason only
        if message is not None:
            assert listed[name]["status"] == "failed" and message in listed[name]["error"], name
            assert listed[name]["bytes"] == 0 and listed[name]["sha256"] is None, name
