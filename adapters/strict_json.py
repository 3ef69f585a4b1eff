"""JSON a tenant wrote, parsed with the bounds Python's json module does not have.

`json.loads` recurses once per nesting level (a deep `[[[[` is a RecursionError, not a ValueError),
accepts `NaN` and `Infinity`, turns `1e999` into inf, keeps the last of two equal keys (while another
reader may keep the first), and stops at 4300 digits with a ValueError that is not a JSONDecodeError.
`loads_strict` refuses each of those with an AdapterError that names the file and, where it can, the field.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from .errors import AdapterError

# 2**64 has 20 digits: enough for any offset, shape or count an adapter file can hold.
MAX_INT_DIGITS = 20
_MAX_SHOWN = 160  # long enough for any real tensor or module name
_OPEN = np.frombuffer(b"[{", dtype=np.uint8)
_CLOSE = np.frombuffer(b"]}", dtype=np.uint8)
# After escaped backslashes and escaped quotes are gone, a JSON string is a quote, non-quotes, a quote.
_STRING = re.compile(r'"[^"]*"')


class _NonFinite:
    """What `NaN`/`Infinity` parse to, so the walk after parsing can name the field that holds one."""

    def __init__(self, token: str):
        self.token = token


def shown(value: Any) -> str:
    """A value for an error message: its repr, cut short (a tenant's value may be a megabyte)."""
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else f"{text[: _MAX_SHOWN - 3]}..."


def nesting_depth(text: str) -> int:
    """The deepest nesting of arrays and objects, counted without recursion and outside strings.

    Exact for valid JSON; on invalid JSON it may count too deep, never too shallow over the prefix that
    json.loads would accept before failing, which is what bounds its recursion.
    """
    unescaped = text.replace("\\\\", "").replace('\\"', "")
    outside = _STRING.sub("", unescaped).encode("utf-8", "surrogatepass")
    codes = np.frombuffer(outside, dtype=np.uint8)
    steps = np.isin(codes, _OPEN).astype(np.int32) - np.isin(codes, _CLOSE).astype(np.int32)
    return int(np.cumsum(steps).max(initial=0))


def loads_strict(data: bytes | str, what: str, max_depth: int) -> Any:
    """Parse `data` (the JSON of the file `what`), or raise an AdapterError naming the file and field."""
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise AdapterError(f"{what} is not UTF-8 text (byte {exc.start})") from None
    else:
        text = data
    depth = nesting_depth(text)
    if depth > max_depth:
        raise AdapterError(f"{what} nests {depth} levels deep; at most {max_depth} are allowed")
    try:
        value = json.loads(
            text,
            parse_constant=_NonFinite,
            parse_int=lambda digits: _bounded_int(digits, what),
            parse_float=float,
            object_pairs_hook=lambda pairs: _unique_keys(pairs, what),
        )
    except json.JSONDecodeError as exc:
        raise AdapterError(
            f"{what} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    _check_values(value, what, "")
    return value


def _bounded_int(digits: str, what: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise AdapterError(f"{what}: an integer of {len(digits)} digits is out of range")
    return int(digits)


def _unique_keys(pairs: list[tuple[str, Any]], what: str) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise AdapterError(f"{what}: key {shown(key)} appears twice in one object")
            seen.add(key)
    return result


def _check_values(value: Any, what: str, path: str) -> None:
    """Refuse non-finite numbers and strings no database or log can hold, naming where they are."""
    if isinstance(value, _NonFinite) or (isinstance(value, float) and not math.isfinite(value)):
        token = value.token if isinstance(value, _NonFinite) else repr(value)
        raise AdapterError(f"{what}: {_cut(path) or 'the value'} must be a finite number, got {token}")
    if isinstance(value, str):
        _check_string(value, what, path)
    elif isinstance(value, dict):
        for key, item in value.items():
            inner = f"{path}.{key}" if path else key
            _check_string(key, what, inner)
            _check_values(item, what, inner)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_values(item, what, f"{path}[{index}]")


def _check_string(text: str, what: str, path: str) -> None:
    # A lone surrogate ("\ud800") cannot be encoded to UTF-8 and NUL cannot be stored in Postgres text.
    where = _cut(path) or "a string"
    if "\x00" in text:
        raise AdapterError(f"{what}: {where} holds a NUL character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise AdapterError(f"{what}: {where} holds an unpaired surrogate (\\ud800-\\udfff)") from None


def _cut(path: str) -> str:
    # The path is made of the tenant's keys: it may be long or hold characters a log line should not.
    safe = ascii(path[:_MAX_SHOWN])[1:-1]
    return safe if len(path) <= _MAX_SHOWN else f"{safe}..."
