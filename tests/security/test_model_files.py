"""Hostile model files: every malformed GGUF or Hugging Face model is a ModelLoadError naming the field,
raised before the model (or anything sized by the file's claims) is allocated.

Each attack of issue 29, item 6 is a case here and failed on the code before it: a 49-byte GGUF claiming
2**62 array items made the `gguf` package's reader loop until memory ran out (run here in a child process
under RLIMIT_AS and a timeout, so the old behaviour fails the test instead of the machine);
`context_length` 2**27 allocated 2 GiB of rotary tables; `block_count` 300000 or `num_hidden_layers` 1e6
built the model before the shape check (36-57 s, 2.7 GiB); 0 heads was a bare ZeroDivisionError. The
in-process cases run with guards that fail the test if the model is built or a rotary table is sized past
what is served, so the old code fails them at once without allocating.

The fuzz tests feed the GGUF header parser built and damaged headers, and the loader damaged copies of a
valid tiny model: every outcome is a parse (or a load) or a ModelLoadError, in memory a small multiple of
the input's size. LORAPLEX_FUZZ_EXAMPLES sets the examples (150 by default for the parser, a third of that
for whole loads); docs/security.md, "Fuzzing", records a longer run.
"""

from __future__ import annotations

import json
import os
import re
import resource
import struct
import subprocess
import sys
import time
import tracemalloc
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from loraplex.engine.model.errors import ModelLoadError
from loraplex.engine.model.loader import load_model

from .model_files import (
    ARRAY,
    FLOAT32,
    INT32,
    STRING,
    UINT8,
    UINT32,
    gguf_bytes,
    gstr,
    kv,
    kv_array,
    kv_u32,
    tensor_info,
    write_tiny_gguf,
    write_tiny_hf,
)

# Bounds the guards hold the loader to, written out (not imported) so the tests run against any version.
ROTARY_ROWS = 1 << 17  # rotary table rows when the engine is not told max_model_len
SECONDS = 10.0  # a refusal takes milliseconds; the attacks took 36-57 s
EXAMPLES = int(os.environ.get("LORAPLEX_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=timedelta(seconds=5),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a refused file gets as far as building the model, or if any load sizes a rotary
    table beyond what is served: the refusal must come before the allocation, not after it."""
    import loraplex.engine.model.llama as llama
    import loraplex.engine.model.loader as loader

    real_model, real_table = loader.LlamaModel, llama.cos_sin_table

    def model(config: Any, *args: Any, **kwargs: Any) -> Any:
        assert config.num_layers <= 4 and config.hidden_size <= 64, f"model built for {config}"
        return real_model(config, *args, **kwargs)

    def table(config: Any, max_positions: int, *args: Any) -> Any:
        assert max_positions <= ROTARY_ROWS, f"rotary tables of {max_positions} rows"
        return real_table(config, max_positions, *args)

    monkeypatch.setattr(loader, "LlamaModel", model)
    monkeypatch.setattr(llama, "cos_sin_table", table)


def refused(source: Path, match: str) -> str:
    started = time.perf_counter()
    with pytest.raises(ModelLoadError, match=match) as caught:
        load_model(source)
    assert time.perf_counter() - started < SECONDS
    return str(caught.value)


# --- the 49-byte file: in a child process under a memory limit ------------------------------------------

_CHILD = """
import json, sys
from loraplex.engine.model.errors import ModelLoadError
from loraplex.engine.model.loader import load_model
try:
    load_model(sys.argv[1])
except ModelLoadError as exc:
    print(json.dumps(["ModelLoadError", str(exc)]))
except BaseException as exc:
    print(json.dumps([type(exc).__name__, str(exc)[:300]]))
else:
    print(json.dumps(["loaded", ""]))
"""
CHILD_MEMORY = 2 << 30  # importing torch takes about 0.7 GiB of address space
CHILD_SECONDS = 90


def load_in_child(path: Path) -> tuple[str, str]:
    """(outcome, message) of load_model(path) in a fresh interpreter limited to CHILD_MEMORY of address
    space and CHILD_SECONDS: a load that runs away ends as MemoryError or a timeout, never takes the host."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))

    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, str(path)],
            capture_output=True,
            text=True,
            timeout=CHILD_SECONDS,
            preexec_fn=limit,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"loading {path.name} ran for over {CHILD_SECONDS} s")
    lines = done.stdout.strip().splitlines()
    assert lines, f"the child died (exit {done.returncode}): {done.stderr[-1500:]}"
    outcome, message = json.loads(lines[-1])
    return outcome, message


@pytest.mark.parametrize(
    "item_type,items",
    [(STRING, "strings"), (UINT8, "items"), (ARRAY, "arrays")],
    ids=["strings", "bytes", "nested-arrays"],
)
def test_a_49_byte_gguf_claiming_2_62_array_items_is_refused_in_bounded_memory(
    tmp_path: Path, item_type: int, items: str
) -> None:
    path = tmp_path / "bomb.gguf"
    path.write_bytes(gguf_bytes([kv_array("a", item_type, 2**62)]))
    assert path.stat().st_size == 49
    outcome, message = load_in_child(path)
    assert outcome == "ModelLoadError", f"{outcome}: {message}"
    assert "array 'a'" in message and (str(2**62) in message or "nested" in message), message


# --- GGUF headers: counts and lengths against the file ---------------------------------------------------

NAME = kv("general.architecture", STRING, gstr("llama"))
ONE_TENSOR = tensor_info("output_norm.weight", (16,))

HEADERS = {
    "tensor count 2**40": (gguf_bytes([NAME], tensor_count=2**40), r"declares 1099511627776 tensors"),
    "key-value count 2**40": (gguf_bytes([NAME], kv_count=2**40), r"declares 1099511627776 key-values"),
    "key length 2**62": (
        gguf_bytes([gstr("k", 2**62) + b"x" * 16]),
        rf"the name of key-value 0 is {2**62} bytes long",
    ),
    "string value length 2**62": (
        gguf_bytes([kv("general.name", STRING, gstr("x", 2**62))]),
        rf"the value of 'general.name' needs {2**62} bytes",
    ),
    "tensor name length 2**62": (
        gguf_bytes([NAME], [gstr("t", 2**62) + b"\0" * 32]),
        r"the name of tensor 0 is \d+ bytes long",
    ),
    "tensor with 2**31 dimensions": (
        gguf_bytes([NAME], [gstr("t") + struct.pack("<I", 2**31) + b"\0" * 40]),
        r"tensor 't' has 2147483648 dimensions",
    ),
    "tensor dimensions of 2**40 x 2**40": (
        gguf_bytes([NAME], [tensor_info("t", (2**40, 2**40))]),
        r"tensor 't': its \d+ bytes at offset \d+ run past the end of the file",
    ),
    "tensor data past the end": (
        gguf_bytes([NAME], [tensor_info("t", (16,), offset=2**20)], b"\0" * 64),
        r"tensor 't': its 64 bytes at offset \d+ run past the end",
    ),
    "tensor offset off the alignment": (
        gguf_bytes([NAME], [tensor_info("t", (4,), offset=8)], b"\0" * 64),
        r"tensor 't': its offset 8 is not a multiple of the alignment 32",
    ),
    "overlapping tensors": (
        gguf_bytes([NAME], [ONE_TENSOR, tensor_info("other", (16,))], b"\0" * 64),
        r"tensor '\w+': its bytes overlap those of tensor",
    ),
    "unknown value type": (
        gguf_bytes([kv("general.name", 99, b"\0" * 8)]),
        r"'general.name' has unknown value type 99",
    ),
    "unknown tensor type": (
        gguf_bytes([NAME], [tensor_info("t", (16,), ggml_type=99)], b"\0" * 64),
        r"tensor 't' has unknown tensor type 99",
    ),
    "rows not whole blocks": (
        gguf_bytes([NAME], [tensor_info("t", (33,), ggml_type=2)], b"\0" * 64),
        r"tensor 't': its rows of 33 values are not whole Q4_0 blocks of 32",
    ),
    "duplicate key": (gguf_bytes([NAME, NAME]), r"key 'general.architecture' appears twice"),
    "duplicate tensor": (gguf_bytes([NAME], [ONE_TENSOR, ONE_TENSOR], b"\0" * 128), r"appears twice"),
    "key not UTF-8": (
        gguf_bytes([gstr(b"\xff\xfe") + struct.pack("<I", UINT8) + b"\0"]),
        r"the name of key-value 0 is not UTF-8",
    ),
    "token not UTF-8": (
        gguf_bytes([kv_array("tokenizer.ggml.tokens", STRING, 2, gstr("ok") + gstr(b"\xc3"))]),
        r"item 1 of array 'tokenizer\.ggml\.tokens' is not UTF-8",
    ),
    "alignment 0": (
        gguf_bytes([kv_u32("general.alignment", 0)]),
        r"general\.alignment must be a power of two",
    ),
    "alignment 3": (
        gguf_bytes([kv_u32("general.alignment", 3)]),
        r"general\.alignment must be a power of two",
    ),
    "version 1": (gguf_bytes(version=1), r"GGUF version 1 is not supported"),
    "big-endian": (gguf_bytes(version=3 << 24), r"big-endian GGUF files are not supported"),
    "cut short": (
        gguf_bytes([NAME])[:-3],
        r"the value of 'general.architecture' needs 5 bytes at offset \d+",
    ),
}


@pytest.mark.parametrize("case", list(HEADERS))
def test_gguf_counts_and_lengths_beyond_the_file_are_refused_naming_the_field(
    tmp_path: Path, guarded: None, case: str
) -> None:
    data, match = HEADERS[case]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    refused(path, match)


# --- GGUF metadata: shapes and counts before the model is built ------------------------------------------

GGUF_FIELDS: list[tuple[str, dict[str, Any], str]] = [
    (
        "block_count 300000",
        {"llama.block_count": 300000},
        r"llama\.block_count must be from 1 to \d+, got 300000",
    ),
    (
        "block_count above the tensors",
        {"llama.block_count": 40},
        r"llama\.block_count is 40, but the checkpoint holds tensors for 2 layers",
    ),
    ("0 heads", {"llama.attention.head_count": 0}, r"llama\.attention\.head_count must be from 1"),
    ("0 kv heads", {"llama.attention.head_count_kv": 0}, r"llama\.attention\.head_count_kv must be from 1"),
    (
        "context_length 2**27",
        {"llama.context_length": 2**27},
        r"llama\.context_length must be from 1 to 16777216, got 134217728",
    ),
    ("hidden 2**40", {"llama.embedding_length": 2**40}, r"llama\.embedding_length must be from 1 to \d+"),
    ("hidden 0", {"llama.embedding_length": 0}, r"llama\.embedding_length must be from 1"),
    (
        "float block_count",
        {"llama.block_count": (FLOAT32, 2.0)},
        r"llama\.block_count must be an integer, got 2\.0",
    ),
    ("string heads", {"llama.attention.head_count": "2"}, r"llama\.attention\.head_count must be an integer"),
    ("bool heads", {"llama.attention.head_count": True}, r"llama\.attention\.head_count must be an integer"),
    (
        "negative heads",
        {"llama.attention.head_count": (INT32, -2)},
        r"llama\.attention\.head_count must be from 1",
    ),
    (
        "NaN epsilon",
        {"llama.attention.layer_norm_rms_epsilon": float("nan")},
        r"llama\.attention\.layer_norm_rms_epsilon must be a finite number above 0",
    ),
    ("rope base 0", {"llama.rope.freq_base": 0.0}, r"llama\.rope\.freq_base must be a finite number above 0"),
    (
        "rope base inf",
        {"llama.rope.freq_base": float("inf")},
        r"llama\.rope\.freq_base must be a finite number",
    ),
    ("vocab 2**31", {"llama.vocab_size": 2**31}, r"llama\.vocab_size .* must be from 1 to \d+"),
    ("odd head_dim", {"llama.attention.key_length": 7}, r"head_dim must be even"),
    (
        "head_dim 2**20",
        {"llama.attention.key_length": 2**20},
        r"llama\.attention\.key_length must be from 1 to 512",
    ),
    (
        "FFN width off the tensors",
        {"llama.feed_forward_length": 48},
        r"shape mismatch for model\.layers\.0\.mlp",
    ),
    (
        "tokens as numbers",
        {"tokenizer.ggml.tokens": [1, 2, 3]},
        r"tokenizer\.ggml\.tokens must be a list of str",
    ),
    (
        "token types as floats",
        {"tokenizer.ggml.token_type": [1.5]},
        r"tokenizer\.ggml\.token_type must be a list",
    ),
    (
        "negative eos",
        {"tokenizer.ggml.eos_token_id": (INT32, -1)},
        r"tokenizer\.ggml\.eos_token_id must be from 0",
    ),
    ("a merge without a space", {"tokenizer.ggml.merges": ["Ġt"]}, r"cannot build its tokenizer"),
    ("name not a string", {"general.name": 7}, r"general\.name must be a string"),
    (
        "add_bos as a number",
        {"tokenizer.ggml.add_bos_token": (UINT32, 1)},
        r"add_bos_token must be true or false",
    ),
]


@pytest.mark.parametrize("overrides,match", [c[1:] for c in GGUF_FIELDS], ids=[c[0] for c in GGUF_FIELDS])
def test_gguf_fields_are_checked_before_the_model_is_built(
    tmp_path: Path, guarded: None, overrides: dict[str, Any], match: str
) -> None:
    refused(write_tiny_gguf(tmp_path / "tiny.gguf", overrides), match)


def test_a_missing_gguf_field_is_named(tmp_path: Path, guarded: None) -> None:
    refused(
        write_tiny_gguf(tmp_path / "t.gguf", drop=("llama.block_count",)),
        r"GGUF metadata has no llama\.block_count",
    )


def test_rotary_tables_are_sized_by_what_the_engine_serves(tmp_path: Path, guarded: None) -> None:
    """A context length a file may claim (2**24) is a promise: the tables hold the positions served, the
    engine's max_model_len, else at most ROTARY_ROWS."""
    path = write_tiny_gguf(tmp_path / "long.gguf", {"llama.context_length": 2**24})
    loaded = load_model(path)
    assert loaded.config.max_position_embeddings == 2**24
    assert loaded.model.rope_cos.shape == (ROTARY_ROWS, 8)
    assert load_model(path, max_positions=64).model.rope_cos.shape == (64, 8)
    short = write_tiny_gguf(tmp_path / "short.gguf")  # a context under the cap is served whole, as before
    assert load_model(short).model.rope_cos.shape == (64, 8)


def test_the_tiny_model_loads_and_the_header_reads_as_the_gguf_package_reads_it(tmp_path: Path) -> None:
    """The oracle: gguf's own reader (unbounded, but fine on a valid file) sees the same keys and tensors."""
    from gguf import GGUFReader

    from loraplex.engine.model.gguf_header import parse_gguf_header
    from loraplex.engine.model.gguf_loader import read_metadata

    path = write_tiny_gguf(tmp_path / "tiny.gguf", {"general.alignment": 64})
    header = parse_gguf_header(path.read_bytes(), path.name)
    reader = GGUFReader(str(path))
    theirs = {k: v for k, v in read_metadata(reader).items() if not k.startswith("GGUF.")}
    assert header.metadata == theirs
    assert [(t.name, t.ggml_type, t.dims, t.offset, t.n_bytes) for t in header.tensors] == [
        (t.name, t.tensor_type, tuple(t.shape.tolist()), t.data_offset, t.n_bytes) for t in reader.tensors
    ]
    assert header.data_offset == reader.data_offset and header.alignment == 64
    assert load_model(path).config.num_layers == 2


# --- Hugging Face config.json and safetensors ------------------------------------------------------------

HF_FIELDS: list[tuple[str, dict[str, Any], str]] = [
    (
        "num_hidden_layers 1e6",
        {"num_hidden_layers": 1e6},
        r"num_hidden_layers must be an integer, got 1000000\.0",
    ),
    ("num_hidden_layers 1000000", {"num_hidden_layers": 1000000}, r"num_hidden_layers must be from 1 to \d+"),
    (
        "layers above the tensors",
        {"num_hidden_layers": 40},
        r"num_hidden_layers is 40, but the checkpoint holds tensors for 2 layers",
    ),
    ("0 heads", {"num_attention_heads": 0}, r"num_attention_heads must be from 1"),
    ("0 kv heads", {"num_key_value_heads": 0}, r"num_key_value_heads must be from 1"),
    ("string width", {"hidden_size": "16"}, r"hidden_size must be an integer"),
    ("huge vocabulary", {"vocab_size": 2**40}, r"vocab_size must be from 1 to \d+"),
    (
        "context 2**27",
        {"max_position_embeddings": 2**27},
        r"max_position_embeddings must be from 1 to 16777216",
    ),
    ("tie as a string", {"tie_word_embeddings": "false"}, r"tie_word_embeddings must be true or false"),
    ("eos as a string", {"eos_token_id": "2"}, r"eos_token_id must be an integer"),
    ("NaN epsilon", {"rms_norm_eps": float("nan")}, r"rms_norm_eps must be a finite number, got NaN"),
    ("negative rope base", {"rope_theta": -1.0}, r"rope_theta must be a finite number above 0"),
    (
        "llama3 scaling without a factor",
        {"rope_scaling": {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
        r"rope_scaling\.factor must be a number, got None",
    ),
    ("rope_scaling a list", {"rope_scaling": [1, 2]}, r"rope_scaling must be an object"),
    (
        "FFN width off the tensors",
        {"intermediate_size": 48},
        r"shape mismatch for model\.layers\.0\.mlp\.gate_proj",
    ),
]


@pytest.mark.parametrize("overrides,match", [c[1:] for c in HF_FIELDS], ids=[c[0] for c in HF_FIELDS])
def test_hf_config_fields_are_checked_before_the_model_is_built(
    tmp_path: Path, guarded: None, overrides: dict[str, Any], match: str
) -> None:
    refused(write_tiny_hf(tmp_path / "hf", overrides), match)


@pytest.mark.parametrize(
    "text,match",
    [
        ("[" * 100_000 + "]" * 100_000, r"nests 100000 levels deep"),
        ("[]", r"must hold a JSON object, got list"),
        ('{"model_type": "llama", "model_type": "qwen2"}', r"key 'model_type' appears twice"),
        ('{"x": "' + "a" * (2 << 20) + '"}', r"bytes; a config\.json has at most"),
        ('{"hidden_size": 1' + "0" * 5000 + "}", r"an integer of 5001 digits is out of range"),
    ],
    ids=["deep", "a list", "duplicate key", "2 MiB", "5000 digits"],
)
def test_hostile_config_json_is_refused(tmp_path: Path, guarded: None, text: str, match: str) -> None:
    directory = write_tiny_hf(tmp_path / "hf")
    (directory / "config.json").write_text(text)
    refused(directory, match)


def test_a_tensor_in_two_safetensors_files_is_refused(tmp_path: Path, guarded: None) -> None:
    directory = write_tiny_hf(tmp_path / "hf")
    (directory / "model-2.safetensors").write_bytes((directory / "model.safetensors").read_bytes())
    refused(directory, r"tensor 'model\.[\w.]+' is also in another file")


# --- fuzzing -------------------------------------------------------------------------------------------

u64 = st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1), st.sampled_from([2**31, 2**62, 2**64 - 1]))
text_bytes = st.one_of(st.text(max_size=12).map(str.encode), st.binary(max_size=12))
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def claimed(n: int) -> st.SearchStrategy[int]:
    """A length or count as written: mostly the truth (so deeper parts get parsed), else any u64."""
    return rarely(u64, st.just(n))


def rarely(odd: st.SearchStrategy[Any], usual: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`odd` one time in eight, else `usual` (hypothesis favours small integers: 0-6 are the usual)."""
    return st.integers(0, 7).flatmap(lambda n: odd if n == 7 else usual)


known_types = st.sampled_from([ARRAY, STRING, *sorted(_SCALAR_BYTES), ARRAY, STRING, ARRAY])
value_types = rarely(st.integers(0, 2**32 - 1), known_types)


@st.composite
def gguf_value(draw: st.DrawFn, value_type: int, depth: int = 0) -> bytes:
    """The bytes of a value of `value_type`: right-sized, or claiming lengths and counts it does not hold."""
    if value_type == STRING:
        raw = draw(text_bytes)
        return gstr(raw, draw(claimed(len(raw))))
    if value_type == ARRAY and depth == 0:
        item_type = draw(value_types)
        items = draw(st.lists(gguf_value(item_type, depth + 1), max_size=6))
        count = draw(claimed(len(items)))
        return struct.pack("<IQ", item_type % 2**32, count) + b"".join(items)
    return draw(
        st.binary(min_size=_SCALAR_BYTES.get(value_type, 0), max_size=_SCALAR_BYTES.get(value_type, 9))
    )


@st.composite
def key_value(draw: st.DrawFn) -> bytes:
    key = draw(
        st.one_of(
            st.sampled_from(["general.alignment", "general.name", "llama.block_count"]), st.text(max_size=10)
        )
    )
    value_type = draw(value_types)
    return (
        gstr(key.encode("utf-8", "surrogatepass"))
        + struct.pack("<I", value_type)
        + draw(gguf_value(value_type))
    )


@st.composite
def tensor(draw: st.DrawFn) -> bytes:
    dims = draw(
        rarely(st.lists(u64, max_size=6), st.lists(st.integers(1, 8) | st.just(32), min_size=1, max_size=4))
    )
    types = st.sampled_from([0, 1, 2, 3, 8, 12, 30])
    ggml_type = draw(rarely(st.integers(0, 2**32 - 1), types))
    offset = draw(st.one_of(st.just(0), st.integers(0, 40).map(lambda n: 32 * n), u64))
    name = draw(text_bytes)
    return gstr(name, draw(claimed(len(name)))) + struct.pack(
        f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset
    )


@st.composite
def gguf_files(draw: st.DrawFn) -> bytes:
    """A GGUF header of random key-values and tensors, counts true or not, then data, then maybe damage."""
    kvs = draw(st.lists(key_value(), max_size=6))
    tensors = draw(st.lists(tensor(), max_size=4))
    data = gguf_bytes(
        kvs,
        tensors,
        draw(st.binary(max_size=600)),
        kv_count=draw(claimed(len(kvs))),
        tensor_count=draw(claimed(len(tensors))),
        version=draw(rarely(st.sampled_from([1, 4, 3 << 24]), st.sampled_from([3, 2]))),
    )
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2, 3]))):
        at = draw(st.integers(8, max(len(data) - 1, 8)))  # magic and version have their own cases
        data = data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1 :]
    if draw(st.integers(0, 3)) == 0:
        data = data[: len(data) - draw(st.integers(0, max(len(data) - 8, 0)))]  # mostly short cuts
    return data


@FUZZ
@given(
    data=st.one_of(
        gguf_files(), gguf_files(), gguf_files(), st.binary(max_size=200).map(b"GGUF\3\0\0\0".__add__)
    )
)
def test_fuzz_the_gguf_header_parser(data: bytes) -> None:
    """Any bytes: a header whose every tensor lies inside the file, or a ModelLoadError; never another
    exception, and never more memory than a small multiple of the input (a count is not a budget)."""
    from loraplex.engine.model.gguf_header import parse_gguf_header

    tracemalloc.start()
    try:
        header = parse_gguf_header(data, "fuzz")
    except ModelLoadError as exc:
        assert str(exc).startswith("fuzz: "), exc
        reason = re.sub(r"[0-9]+", "N", re.sub(r"'.*'", "K", str(exc)))  # one event per kind of refusal
        event(f"refused: {reason[6:70]}")
        header = None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak <= 32 * len(data) + (64 << 10), f"{peak} bytes for a {len(data)}-byte file"
    if header is not None:
        event("parsed")
        assert all(t.offset + t.n_bytes <= len(data) for t in header.tensors)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, int]:
    """The valid tiny model's bytes and where its tensor data starts (damage there is only bad weights)."""
    from loraplex.engine.model.gguf_header import parse_gguf_header

    data = write_tiny_gguf(tmp_path_factory.mktemp("fuzz") / "tiny.gguf").read_bytes()
    return data, parse_gguf_header(data).data_offset


@settings(FUZZ, max_examples=max(EXAMPLES // 3, 1))
@given(
    edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=4)
)
def test_fuzz_loading_a_damaged_tiny_model(
    tmp_path: Path, guarded: None, tiny_gguf: tuple[bytes, int], edits: list[tuple[float, int]]
) -> None:
    """A valid model with a few bytes changed in its header: loaded, or a ModelLoadError; nothing else."""
    data, header_bytes = tiny_gguf
    damaged = bytearray(data)
    for where, byte in edits:
        damaged[int(where * header_bytes)] = byte
    path = tmp_path / "damaged.gguf"
    path.write_bytes(bytes(damaged))
    try:
        load_model(path)
        event("loaded")
    except ModelLoadError:
        event("refused")
