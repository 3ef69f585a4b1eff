"""Configuration declared once: EngineConfig, ServerSettings and the CLI's flags are one set of options.

Each test goes through the real doors: `EngineConfig(...)`, `ServerSettings()` reading LORAPLEX_* variables
from the process environment, and `loraplex`'s own argparse tree (argparse exits 2 on a refused flag).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import ValidationError

from loraplex.cli.main import build_parser
from loraplex.cli.up import ENGINE_OPTIONS_FOR_UP, engine_command
from loraplex.engine.config import ENGINE_OPTIONS, EngineConfig
from loraplex.engine.options import (
    Opt,
    Option,
    OptionError,
    add_arguments,
    command_line,
    from_environment,
    markdown_table,
    options_of,
    values_given,
)
from loraplex.engine.server.settings import ALL_OPTIONS, SERVER_OPTIONS, ServerSettings, model_path
from loraplex.operator.resources import desired_objects
from loraplex.operator.spec import parse
from loraplex.wire import AdapterRegistration
from tests.operator.helpers import EXAMPLES, body

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(autouse=True)
def no_option_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts from an environment without the options' variables (the shell may set some)."""
    for option in ALL_OPTIONS:
        for variable in option.variables:
            monkeypatch.delenv(variable, raising=False)
    monkeypatch.delenv("LORAPLEX_INTERNAL_TOKEN", raising=False)
    monkeypatch.delenv("LORAPLEX_ADAPTERS", raising=False)


def option(name: str) -> Option:
    return next(o for o in ALL_OPTIONS if o.name == name)


def refused_flag(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What `loraplex ARGV` says on stderr when argparse refuses it; it must exit 2."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


# --- one refusal, three doors -------------------------------------------------------------------------

# (option, the Python value, the same value as a flag or variable spells it, the message every door gives)
INVALID = [
    ("max_num_seqs", 0, "0", "max_num_seqs must be an integer of 1 or more, got 0"),
    ("page_size", -4, "-4", "page_size must be an integer of 1 or more, got -4"),
    ("max_num_seqs", "many", "many", "max_num_seqs must be an integer of 1 or more, got 'many'"),
    ("num_pages", 1, "1", "num_pages must be an integer of 2 or more, got 1"),
    ("gpu_memory_fraction", 1.5, "1.5", "gpu_memory_fraction must be a number above 0 and below 1, got 1.5"),
    ("gpu_memory_fraction", 0.0, "0", "gpu_memory_fraction must be a number above 0 and below 1, got 0.0"),
    ("gpu_memory_fraction", float("nan"), "nan", "gpu_memory_fraction must be a number above 0 and below 1"),
    ("dtype", "float8", "float8", "dtype must be one of auto, float32, bfloat16, float16, got 'float8'"),
    ("device", "tpu", "tpu", "device must be one of auto, cpu, cuda, cuda:N, got 'tpu'"),
    ("device", "cuda:x", "cuda:x", "device must be one of auto, cpu, cuda, cuda:N, got 'cuda:x'"),
    ("kernels", "cuda", "cuda", "kernels must be one of auto, triton, torch, got 'cuda'"),
    (
        "model",
        "s3://models/a/../b",
        "s3://models/a/../b",
        "model: s3://models/a/../b: give the object or folder, s3://bucket/path/model.gguf or s3://bucket/path/",
    ),
    (
        "model",
        "hf://not a repo",
        "hf://not a repo",
        "model: 'hf://not a repo' is not hf://org/name[@revision]",
    ),
    ("seed", -1, "-1", "seed must be an integer from 0 to 2**64 - 1, got -1"),
]


@pytest.mark.parametrize(("name", "value", "text", "message"), INVALID, ids=lambda v: str(v)[:24])
def test_an_invalid_value_is_refused_the_same_way_at_every_door(
    name: str, value: Any, text: str, message: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    # Python: EngineConfig raises ValueError; ServerSettings a ValidationError (a ValueError) saying it.
    with pytest.raises(ValueError) as python:
        EngineConfig(**{name: value})
    assert str(python.value).startswith(message)
    with pytest.raises(ValidationError, match=re.escape(message)):
        ServerSettings(**{name: value})

    # A variable: refused when the settings are made (loraplex serve's start), naming the variable.
    variable = option(name).variables[0]
    monkeypatch.setenv(variable, text)
    with pytest.raises(OptionError) as environment:
        ServerSettings()
    assert str(environment.value).startswith(f"{variable}={text}: {message}")
    monkeypatch.delenv(variable)

    # A flag, on each command that takes it: exit 2 with the same words; `serve` says them in one line
    # (as Kubernetes shows it), the others after argparse's usage and the flag's name.
    flag = option(name).flags[0]
    said = refused_flag(["serve", f"{flag}={text}"], capsys)
    assert said.startswith(f"loraplex serve: {message}") and said.count("\n") == 1, said
    for command in (["generate", "--prompt", "hi"], ["up"]):
        if command == ["up"] and name == "model":
            continue  # up always serves the demo's model
        said = refused_flag([*command, f"{flag}={text}"], capsys)
        assert f"argument {'/'.join(option(name).flags)}: {message}" in said, said


def test_the_old_spelling_is_refused_with_the_option_s_name(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    message = "gpu_memory_fraction must be a number above 0 and below 1, got 1.5"
    with pytest.raises(ValidationError, match=re.escape(message)):
        ServerSettings(pool_fraction=1.5)
    assert f"argument --gpu-memory-fraction/--pool-fraction: {message}" in refused_flag(
        ["generate", "--prompt", "hi", "--pool-fraction", "1.5"], capsys
    )
    assert refused_flag(["serve", "--pool-fraction", "1.5"], capsys) == f"loraplex serve: {message}\n"
    monkeypatch.setenv("LORAPLEX_POOL_FRACTION", "1.5")
    with pytest.raises(OptionError, match=re.escape(f"LORAPLEX_POOL_FRACTION=1.5: {message}")):
        ServerSettings()


def test_the_old_spelling_works_and_two_spellings_must_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ServerSettings(pool_fraction=0.5).engine_config().gpu_memory_fraction == 0.5
    with pytest.raises(ValidationError, match="one option"):
        ServerSettings(pool_fraction=0.5, gpu_memory_fraction=0.6)
    monkeypatch.setenv("LORAPLEX_POOL_FRACTION", "0.5")
    assert ServerSettings().engine_config().gpu_memory_fraction == 0.5
    monkeypatch.setenv("LORAPLEX_GPU_MEMORY_FRACTION", "0.50")
    assert ServerSettings().engine_config().gpu_memory_fraction == 0.5  # the same value twice is fine
    monkeypatch.setenv("LORAPLEX_GPU_MEMORY_FRACTION", "0.6")
    with pytest.raises(OptionError, match="each sets gpu_memory_fraction, differently"):
        ServerSettings()
    # A flag wins over the variables, so a flag given never trips over them.
    assert ServerSettings(gpu_memory_fraction=0.7).engine_config().gpu_memory_fraction == 0.7


def test_server_options_are_refused_the_same_way(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    message = "port must be an integer from 0 to 65535, got 70000"
    with pytest.raises(ValidationError, match=re.escape(message)):
        ServerSettings(port=70000)
    assert refused_flag(["serve", "--port", "70000"], capsys) == f"loraplex serve: {message}\n"
    monkeypatch.setenv("LORAPLEX_PORT", "70000")
    with pytest.raises(OptionError, match=re.escape(f"LORAPLEX_PORT=70000: {message}")):
        ServerSettings()


def test_settings_refuse_what_no_option_is() -> None:
    with pytest.raises(ValidationError, match="max_num_seq"):
        ServerSettings(max_num_seq=4)  # a typo is not quietly a default
    with pytest.raises(TypeError):
        EngineConfig(**{"max_num_seq": 4})


def test_a_bad_adapters_variable_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_ADAPTERS", "a=/x")
    with pytest.raises(OptionError, match="LORAPLEX_ADAPTERS must be a JSON list of strings"):
        ServerSettings()
    monkeypatch.setenv("LORAPLEX_ADAPTERS", '["a=/x"]')
    assert ServerSettings().start_adapters() == [AdapterRegistration("a", "/x", None)]


# --- every option round-trips -------------------------------------------------------------------------


def sample(option: Option) -> Any:
    """A valid value other than the default."""
    opt = option.opt
    if option.kind is bool:
        return not option.default
    if option.kind is str:
        if opt.choices:
            return next(c for c in reversed(opt.choices) if c != option.default)
        return f"/srv/loraplex/{option.name}"
    low = opt.minimum if opt.minimum is not None else opt.above
    high = opt.maximum if opt.maximum is not None else opt.below
    if option.kind is float:
        low = 0.0 if low is None else low
        return (low + high) / 2 if high is not None else low + 2.5
    value = int(low or 0) + 3
    return value if value != option.default else value + 1


def engine_samples() -> dict[str, Any]:
    return {o.name: sample(o) for o in ENGINE_OPTIONS}


def test_samples_differ_from_the_defaults() -> None:
    for option in ALL_OPTIONS:  # else the round trips below could pass on defaults alone
        assert sample(option) != option.default, option.name
        assert option.convert(sample(option)) == sample(option), option.name


def test_every_engine_option_round_trips_flag_to_config() -> None:
    values = engine_samples()
    expected = EngineConfig(**values)
    flags = command_line(ENGINE_OPTIONS, values)

    serve = build_parser().parse_args(["serve", *flags])
    assert ServerSettings(**values_given(serve, ALL_OPTIONS)).engine_config() == expected

    generate = build_parser().parse_args(["generate", "--prompt", "hi", *flags])
    assert EngineConfig(**values_given(generate, ENGINE_OPTIONS)) == expected

    up_flags = command_line(ENGINE_OPTIONS_FOR_UP, values)
    up = build_parser().parse_args(["up", *up_flags])
    serve_argv = engine_command(8123, up)[3:]  # after python -m loraplex.cli.main
    passed_on = build_parser().parse_args(serve_argv)
    assert passed_on.port == 8123 and passed_on.host == "127.0.0.1"
    assert ServerSettings(**values_given(passed_on, ALL_OPTIONS)).engine_config() == EngineConfig(
        **{**values, "model": None}
    )


def test_every_engine_option_round_trips_environment_to_config(monkeypatch: pytest.MonkeyPatch) -> None:
    values = engine_samples()
    for option in ENGINE_OPTIONS:
        monkeypatch.setenv(option.variables[0], option.to_text(values[option.name]))
    assert ServerSettings().engine_config() == EngineConfig(**values)


def test_every_server_option_round_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    values = {o.name: sample(o) for o in SERVER_OPTIONS}
    args = build_parser().parse_args(["serve", *command_line(SERVER_OPTIONS, values)])
    from_flags = ServerSettings(**values_given(args, ALL_OPTIONS))
    assert {name: getattr(from_flags, name) for name in values} == values
    for option in SERVER_OPTIONS:
        monkeypatch.setenv(option.variables[0], option.to_text(values[option.name]))
    from_environment_ = ServerSettings()
    assert {name: getattr(from_environment_, name) for name in values} == values


def test_flags_win_over_variables_and_variables_over_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_MAX_NUM_SEQS", "8")
    monkeypatch.setenv("LORAPLEX_NUM_PAGES", "40")
    args = build_parser().parse_args(["serve", "--max-num-seqs", "4"])
    config = ServerSettings(**values_given(args, ALL_OPTIONS)).engine_config()
    assert (config.max_num_seqs, config.num_pages, config.page_size) == (4, 40, 16)
    monkeypatch.setenv("LORAPLEX_NUM_PAGES", "")  # empty: unset
    assert ServerSettings().engine_config().num_pages is None


def test_python_values_are_converted_like_text() -> None:
    given: dict[str, Any] = {
        "max_num_seqs": "8",
        "gpu_memory_fraction": 1 / 2,
        "model_cache": Path("/srv/cache"),
    }
    config = EngineConfig(**given)
    assert (config.max_num_seqs, config.gpu_memory_fraction, config.model_cache) == (8, 0.5, "/srv/cache")
    with pytest.raises(ValueError, match="max_num_seqs must be an integer of 1 or more, got True"):
        EngineConfig(max_num_seqs=True)
    with pytest.raises(ValueError, match=r"max_num_seqs must be an integer of 1 or more, got 8\.0"):
        EngineConfig(**{"max_num_seqs": 8.0})


def test_the_server_settles_max_batch_tokens_the_engine_refuses(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match=r"max_batch_tokens \(16\) must be at least max_num_seqs \(32\)"):
        EngineConfig(max_batch_tokens=16, max_num_seqs=32)
    assert ServerSettings(max_batch_tokens=16, max_num_seqs=32).engine_config().max_batch_tokens == 32
    assert "max_batch_tokens 16 is below max_num_seqs 32: raised to 32" in caplog.text


@pytest.mark.parametrize("example", [path.name for path in EXAMPLES])
def test_the_operator_s_engine_pod_makes_the_engine_config_its_cr_asks_for(
    example: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pod's command line through loraplex's parser, its ConfigMap as the environment: what `loraplex
    # serve` would run the engine with.
    spec = parse(body(example)).spec
    objects = desired_objects(parse(body(example)))
    engine = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][
        0
    ]
    for config_map in (o for o in objects if o["kind"] == "ConfigMap"):
        for name, value in config_map["data"].items():
            monkeypatch.setenv(name, value)
    argv = [*engine["command"], *engine["args"]]
    assert argv[0] == "loraplex"
    args = build_parser().parse_args(argv[1:])
    config = ServerSettings(**values_given(args, ALL_OPTIONS)).engine_config()
    assert config.model == model_path(spec.model.uri) and config.dtype == spec.model.dtype
    assert config.gpu_memory_fraction == spec.engine.pool_fraction  # LORAPLEX_POOL_FRACTION, the old name
    assert config.max_resident_adapters == spec.engine.max_resident_adapters
    assert config.device == ("cuda" if spec.resources.gpus_per_replica > 0 else "cpu")
    extra = build_parser().parse_args(["serve", *spec.engine.extra_args])
    assert config.max_num_seqs == (extra.max_num_seqs or EngineConfig.max_num_seqs)
    assert config.max_batch_tokens == max(spec.engine.max_batch_tokens, config.max_num_seqs)


# --- the machinery, on a yes/no option (the engine has none yet) -----------------------------------------


@dataclass
class Toggles:
    stream_weights: Annotated[bool, Opt("read weights while serving", aliases=("lazy_weights",))] = False
    cache_dir: Annotated[str | None, Opt("a place", requirement="a directory path", none="nowhere")] = None


def test_a_yes_no_option_reads_every_spelling_and_refuses_the_rest(capsys: Any) -> None:
    (toggle,) = (o for o in options_of(Toggles) if o.name == "stream_weights")
    assert (toggle.kind, toggle.optional, toggle.default) == (bool, False, False)
    for text, meaning in (("true", True), ("YES", True), ("1", True), ("off", False), ("0", False)):
        assert toggle.convert(text) is meaning
    message = "stream_weights must be true or false, got 'maybe'"
    with pytest.raises(OptionError, match=re.escape(message)):
        toggle.convert("maybe")
    with pytest.raises(OptionError, match="stream_weights must be true or false, got 2"):
        toggle.convert(2)
    with pytest.raises(OptionError, match=re.escape(f"LORAPLEX_STREAM_WEIGHTS=maybe: {message}")):
        from_environment([toggle], {"LORAPLEX_STREAM_WEIGHTS": "maybe"})
    assert from_environment([toggle], {"LORAPLEX_LAZY_WEIGHTS": "on"}) == {"stream_weights": True}

    parser = argparse.ArgumentParser(prog="toggles")
    add_arguments(parser, [toggle])
    assert parser.parse_args([]).stream_weights is None  # unset: the variable or the default decides
    assert parser.parse_args(["--stream-weights"]).stream_weights is True
    assert parser.parse_args(["--no-lazy-weights"]).stream_weights is False
    assert command_line([toggle], {"stream_weights": False}) == ["--no-stream-weights"]


def test_a_path_option_takes_paths_and_refuses_empty_ones(capsys: Any) -> None:
    place = options_of(Toggles)[1]
    assert place.convert(Path("/srv/x")) == "/srv/x" and place.convert(None) is None
    for bad in ("", "a\x00b", 7):
        with pytest.raises(OptionError, match=re.escape(f"cache_dir must be a directory path, got {bad!r}")):
            place.convert(bad)
    message = "model_cache must be a directory path, got ''"
    assert f"argument --model-cache: {message}" in refused_flag(["up", "--model-cache", ""], capsys)
    assert refused_flag(["serve", "--model-cache", ""], capsys) == f"loraplex serve: {message}\n"
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(model_cache="")


# --- the definition itself ----------------------------------------------------------------------------


def test_every_engine_config_field_is_an_option_and_every_setting_is_one() -> None:
    assert [f.name for f in fields(EngineConfig)] == [o.name for o in ENGINE_OPTIONS]
    not_options = {"internal_token", "adapters"}  # a secret (no flag) and a list (--adapter repeated)
    assert set(ServerSettings.model_fields) == {o.name for o in ALL_OPTIONS} | not_options
    names = [name for o in ALL_OPTIONS for name in o.names]
    assert len(names) == len(set(names)), "two options share a name"
    for o in ENGINE_OPTIONS:
        assert o.convert(o.default) == o.default, f"{o.name}'s default is not a value it allows"


def test_serve_has_a_flag_for_every_option_and_nothing_else() -> None:
    serve = build_parser().parse_args(["serve"]).command_parser
    flags = {s for action in serve._actions for s in action.option_strings} - {"-h", "--help", "--adapter"}
    negated = {f"--no-{flag[2:]}" for o in ALL_OPTIONS if o.kind is bool for flag in o.flags}
    assert flags == {flag for o in ALL_OPTIONS for flag in o.flags} | negated


@pytest.mark.parametrize(
    ("doc", "block", "options", "command"),
    [
        ("configuration.md", "engine-options", ENGINE_OPTIONS, "python -m loraplex.engine.config"),
        ("server.md", "server-options", SERVER_OPTIONS, "python -m loraplex.engine.server.settings"),
    ],
)
def test_the_docs_tables_are_the_definition(
    doc: str, block: str, options: tuple[Option, ...], command: str
) -> None:
    text = (DOCS / doc).read_text()
    found = re.search(rf"<!-- {block}:[^\n]*-->\n(.*?)<!-- end {block} -->", text, re.S)
    assert found, f"docs/{doc} has lost its {block} block"
    assert found.group(1) == markdown_table(options), (
        f"docs/{doc}'s table is stale: replace it with `{command}`"
    )


def test_building_the_parser_does_not_import_torch() -> None:
    code = "import sys; from loraplex.cli.main import build_parser as b; b(); print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ}
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"  # `loraplex --help` and the operator's pods stay quick
