"""The gateway ↔ engine wire contract (loraplex.wire): torch-free, round-trips, and the only copy."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from loraplex import wire

ROOT = Path(__file__).resolve().parents[1]
SHA = "ab" * 32


def test_imports_with_torch_fastapi_and_pydantic_blocked() -> None:
    """A control plane without the engine's dependencies (and an engine without the web's) imports it."""
    code = (
        "import sys\n"
        "for name in ('torch', 'triton', 'fastapi', 'starlette', 'pydantic', 'sqlalchemy', 'httpx'):\n"
        "    sys.modules[name] = None  # any import of it raises ImportError\n"
        "from loraplex import wire\n"
        "ref = wire.AdapterRef('42', 'file:///a', 'ab' * 32)\n"
        "assert wire.adapter_from_headers(wire.request_headers('t', wire.TenantRef('tenant'), ref)) == ref\n"
        "assert wire.adapter_id_of(wire.adapter_name('42')) == '42'\n"
        "error = wire.WireError('m', wire.SERVER_ERROR, wire.ENGINE_ERROR)\n"
        "assert wire.parse_error(__import__('json').dumps(error.body()).encode()) == error\n"
        "from loraplex.wire import errors, limits\n"
        "assert errors.failure_error(errors.StepError('x')).code == wire.ENGINE_ERROR\n"
        "limits.check_stop(['a'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'loraplex'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    modules = "['loraplex', 'loraplex.wire', 'loraplex.wire.errors', 'loraplex.wire.limits']"
    assert result.stdout.strip() == modules


def test_each_failure_has_one_code_and_one_status() -> None:
    """The one table: a failure's code read back from an ended request answers as the failure itself."""
    from loraplex.wire import errors

    assert len(errors.BY_CODE) == len(errors.ANSWERS)  # no code answers two failures
    for failure, row in errors.ANSWERS.items():
        raised = failure(3, 4) if failure is errors.QueueFull else failure("why")
        error = errors.failure_error(raised)
        assert (error.status, error.kind, error.code) == (row.status, row.kind, row.code)
        assert errors.answer_code(row.code, str(raised)).body() == error.body()
        assert bool(error.headers) == row.retry
    unknown = errors.failure_error(KeyError("k"))
    assert (unknown.status, unknown.code, unknown.message) == (500, wire.ENGINE_ERROR, "KeyError: 'k'")
    assert errors.answer_code(None, "m").code == wire.ENGINE_ERROR


@pytest.mark.parametrize("adapter_id", [uuid.UUID(int=7), "plain", "with:colon", "a/b c"])
def test_adapter_names_round_trip(adapter_id: uuid.UUID | str) -> None:
    name = wire.adapter_name(adapter_id)
    assert name.startswith(wire.ADAPTER_NAME_PREFIX)
    assert wire.is_gateway_adapter(name)
    assert wire.adapter_id_of(name) == str(adapter_id)


def test_other_names_are_not_the_gateways() -> None:
    assert wire.adapter_id_of("mine") is None
    assert wire.adapter_id_of("id:") is None  # the prefix alone names no adapter
    assert not wire.is_gateway_adapter("identity")
    with pytest.raises(ValueError, match="empty"):
        wire.adapter_name("")


def test_headers_round_trip_through_a_case_insensitive_reader() -> None:
    ref = wire.AdapterRef(str(uuid.uuid4()), "s3://bucket/adapters/x", SHA)
    sent = wire.request_headers("secret", wire.TenantRef("tenant-a"), ref)
    assert sent[wire.INTERNAL_TOKEN_HEADER] == "secret" and sent[wire.TENANT_HEADER] == "tenant-a"
    assert set(wire.GATEWAY_HEADERS) <= set(sent)
    received = {k.lower(): v for k, v in sent.items()}  # HTTP header names are case-insensitive

    class Headers(dict[str, str]):
        def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
            return super().get(key.lower(), default)

    read = wire.adapter_from_headers(Headers(received))
    assert read == ref and read is not None and read.name == wire.adapter_name(ref.adapter_id)


def test_base_model_headers_name_no_adapter() -> None:
    sent = wire.request_headers("secret", wire.TenantRef("tenant-a"))
    assert wire.ADAPTER_ID_HEADER not in sent and wire.ADAPTER_URI_HEADER not in sent
    assert wire.adapter_from_headers(sent) is None
    unverified = wire.request_headers("s", wire.TenantRef("t"), wire.AdapterRef("1", "file:///a"))
    assert wire.ADAPTER_SHA256_HEADER not in unverified
    assert wire.adapter_from_headers(unverified) == wire.AdapterRef("1", "file:///a", None)


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({wire.ADAPTER_ID_HEADER: "1"}, wire.ADAPTER_URI_MISSING),
        ({wire.ADAPTER_ID_HEADER: "1", wire.ADAPTER_URI_HEADER: ""}, wire.ADAPTER_URI_MISSING),
        (
            {wire.ADAPTER_ID_HEADER: "1", wire.ADAPTER_URI_HEADER: "u", wire.ADAPTER_SHA256_HEADER: "ab"},
            wire.ADAPTER_SHA256_INVALID,
        ),
        (
            {wire.ADAPTER_ID_HEADER: "1", wire.ADAPTER_URI_HEADER: "u", wire.ADAPTER_SHA256_HEADER: "g" * 64},
            wire.ADAPTER_SHA256_INVALID,
        ),
    ],
)
def test_bad_adapter_headers_are_refused_with_their_code(headers: dict[str, str], code: str) -> None:
    with pytest.raises(wire.BadHeaders) as refused:
        wire.adapter_from_headers(headers)
    assert refused.value.code == code


@pytest.mark.parametrize(
    "error",
    [
        wire.WireError("the adapter's weights are not finite", wire.INVALID_REQUEST, wire.ADAPTER_FAILED),
        wire.WireError("store down", wire.SERVER_ERROR, wire.ADAPTER_UNAVAILABLE),
        wire.WireError("stop has 17 sequences", wire.INVALID_REQUEST, wire.LIMIT_EXCEEDED, "stop"),
        wire.WireError("no code at all", wire.SERVER_ERROR),
    ],
)
def test_errors_round_trip(error: wire.WireError) -> None:
    body = error.body()
    assert set(body["error"]) == {"message", "type", "param", "code"}  # OpenAI's shape, all four always
    assert body == wire.error_body(error.message, error.type, error.code, error.param)
    assert wire.parse_error(json.dumps(body).encode()) == error
    assert wire.WireError.from_body(body) == error


@pytest.mark.parametrize(
    "content",
    [b"", b"not json", b"[1]", b'{"error": "flat"}', b'{"choices": []}', b"[" * 100_000],
)
def test_what_is_not_an_error_body_parses_to_none(content: bytes) -> None:
    assert wire.parse_error(content) is None


def test_odd_error_fields_read_as_absent() -> None:
    odd = wire.parse_error(b'{"error": {"message": 5, "type": null, "code": ["x"], "param": {}}}')
    assert odd == wire.WireError("", wire.SERVER_ERROR, None, None)


def test_adapter_paths_keep_the_name_in_one_segment() -> None:
    assert wire.adapter_path("mine") == "/internal/adapters/mine"
    assert wire.adapter_path("id:1") == "/internal/adapters/id%3A1"
    assert wire.adapter_path("a/b?c#d") == "/internal/adapters/a%2Fb%3Fc%23d"


def test_the_engines_registration_model_has_the_contracts_fields() -> None:
    from loraplex.engine.server import protocol

    fields = protocol.AdapterRegistration.model_fields
    assert list(fields) == [f.name for f in dataclasses.fields(wire.AdapterRegistration)]
    registration = wire.AdapterRegistration("id:1", "file:///a", SHA)
    validated = protocol.AdapterRegistration.model_validate(registration.body())
    assert validated.model_dump() == registration.body()


# Source folders whose code talks over the wire; tests spell the strings on purpose (they check the contract).
SOURCE_FOLDERS = ("engine", "web", "cli", "adapters", "operator", "bench")
ERROR_CODES = sorted(
    value
    for name, value in vars(wire).items()
    if name.isupper() and isinstance(value, str) and value.isidentifier() and value.islower()
)


def spelled_outside_wire(pattern: re.Pattern[str]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in SOURCE_FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        # Metric label values are Prometheus' vocabulary, not the wire's, even where they read alike.
        if pattern.search(line) and ".labels(" not in line
    ]


@pytest.mark.parametrize("pattern", [r"x-loraplex-", r"""["']id:"""])
def test_only_the_wire_module_spells_headers_and_adapter_names(pattern: str) -> None:
    offenders = spelled_outside_wire(re.compile(pattern, re.IGNORECASE))
    assert offenders == [], f"{pattern!r} spelled outside wire/: {offenders}"


def test_only_the_wire_module_spells_error_codes() -> None:
    assert {wire.ADAPTER_FAILED, wire.ENGINE_ERROR, wire.REQUEST_TOO_LARGE} <= set(ERROR_CODES)
    pattern = re.compile("|".join(rf"""["']{re.escape(code)}["']""" for code in ERROR_CODES))
    offenders = spelled_outside_wire(pattern)
    assert offenders == [], f"error codes spelled outside wire/: {offenders}"
