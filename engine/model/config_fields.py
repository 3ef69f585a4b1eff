"""Typed, bounded reads of a model file's config fields (GGUF metadata or config.json), torch-free.

A field read with `int(...)` accepts 1e6 as a layer count, True as a head count and "64" as a width, and a
zero head count reaches `hidden // heads` as a bare ZeroDivisionError. These helpers take the file's own
value, check its type and range, and raise a ModelLoadError naming the file and the field as the file
spells it (`llama.block_count`, `num_hidden_layers`), before any shape is derived from it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from .errors import ModelLoadError

_SHOWN = 60  # characters of a bad value quoted in an error
T = TypeVar("T")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[: _SHOWN - 3]}..."


def integer(value: Any, field: str, source: Path | str, minimum: int, maximum: int) -> int:
    """`value` as an int in [minimum, maximum]; bools and floats (1e6) are refused, not converted."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"{source}: {field} must be an integer, got {_shown(value)}")
    if not minimum <= value <= maximum:
        raise ModelLoadError(f"{source}: {field} must be from {minimum} to {maximum}, got {value}")
    return value


def positive_real(value: Any, field: str, source: Path | str, maximum: float = math.inf) -> float:
    """`value` as a finite float in (0, maximum]; ints are welcome (rope_theta: 10000)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelLoadError(f"{source}: {field} must be a number, got {_shown(value)}")
    number = float(value)
    if not (math.isfinite(number) and 0 < number <= maximum):
        bound = "a finite number above 0" if maximum == math.inf else f"above 0 and at most {maximum:g}"
        raise ModelLoadError(f"{source}: {field} must be {bound}, got {_shown(value)}")
    return number


def flag(value: Any, field: str, source: Path | str) -> bool:
    if not isinstance(value, bool):
        raise ModelLoadError(f"{source}: {field} must be true or false, got {_shown(value)}")
    return value


def text(value: Any, field: str, source: Path | str, max_chars: int = 1024) -> str:
    if not isinstance(value, str) or len(value) > max_chars:
        raise ModelLoadError(f"{source}: {field} must be a string of at most {max_chars} characters")
    return value


def token_id(value: Any, field: str, source: Path | str) -> int | None:
    return None if value is None else integer(value, field, source, 0, 2**31 - 1)


def token_ids(value: Any, field: str, source: Path | str) -> tuple[int, ...]:
    """One id, a list of ids (Llama 3's eos_token_id), or none."""
    if isinstance(value, list):
        if len(value) > 64:
            raise ModelLoadError(f"{source}: {field} lists {len(value)} ids; at most 64 are allowed")
        return tuple(integer(v, f"{field}[{i}]", source, 0, 2**31 - 1) for i, v in enumerate(value))
    one = token_id(value, field, source)
    return () if one is None else (one,)


def list_of(value: Any, item: type[T], field: str, source: Path | str) -> list[T]:
    """A list whose every item is an `item` (tokenizer arrays); bools do not pass for ints."""
    if not isinstance(value, list) or not all(
        isinstance(v, item) and not (item is int and isinstance(v, bool)) for v in value
    ):
        raise ModelLoadError(f"{source}: {field} must be a list of {item.__name__} values")
    return value


def build(make: Callable[[], T], source: Path | str) -> T:
    """A ModelConfig or RopeScaling from checked fields; what their own checks refuse (heads not a
    multiple of kv heads, an odd head_dim, rope factors out of order) is a ModelLoadError too."""
    try:
        return make()
    except ModelLoadError:
        raise  # a field check inside `make` has already named the file and the field
    except ValueError as exc:
        raise ModelLoadError(f"{source}: {exc}") from None
