"""Options declared once, read through every door: Python, `LORAPLEX_*` variables and command-line flags.

An option is a typed field whose annotation carries an `Opt`: `max_num_seqs: Annotated[int, Opt("requests
in the running batch at most", minimum=1)] = 64`. The field gives the name, the type and the default; the
`Opt` gives the help text, the allowed values and any old spellings. From that one declaration:

- `Option.convert` turns a Python value or a string (from a variable or a flag) into the field's type, or
  raises `OptionError` with one message for every door: `max_num_seqs must be an integer of 1 or more,
  got 0`;
- `add_arguments` builds the argparse flags (`--max-num-seqs`), whose type function is `convert`, so a bad
  flag exits 2 with that message;
- `from_environment` reads `LORAPLEX_MAX_NUM_SEQS` (and the variables of old spellings) through `convert`;
- `markdown_table` writes the table that docs/configuration.md carries (a test compares the two).

EngineConfig (engine/config.py) and the server's own options (engine/server/settings.py) are declared
this way. No torch here: the CLI builds its parser from these declarations, and `loraplex --help` must not
wait for torch.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "LORAPLEX_"
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_KINDS = (bool, int, float, str)


class OptionError(ValueError):
    """A value an option does not allow; the message names the option, what it allows and what it got."""


@dataclass(frozen=True)
class Opt:
    """What an option's annotation adds to its field: help, the values allowed, old names.

    Bounds: `minimum`/`maximum` are inclusive, `above`/`below` exclusive. `choices` are the words allowed
    (strings); `pattern` (a full match) admits further ones, such as `cuda:0`. `check` is a further test
    for strings (raising ValueError with the reason). `requirement` says in words what is allowed where
    the bounds and choices cannot (`one of auto, cpu, cuda, cuda:N`). `aliases` are old names, still read
    as flags and variables (`pool_fraction`: `--pool-fraction`, `LORAPLEX_POOL_FRACTION`). `none` says
    what None, the default of an optional option, means. `unit="bytes"` shows sizes in KiB/MiB/GiB in the
    docs.
    """

    help: str
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None
    below: float | None = None
    choices: tuple[str, ...] = ()
    pattern: str | None = None
    check: Callable[[str], object] | None = None
    requirement: str | None = None
    aliases: tuple[str, ...] = ()
    none: str = ""
    unit: str = ""
    metavar: str | None = None


@dataclass(frozen=True)
class Option:
    """One option: a field's name, type and default with its `Opt`."""

    name: str
    kind: type  # bool, int, float or str
    optional: bool  # None is allowed (and then the default)
    default: Any
    opt: Opt

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.opt.aliases)

    @property
    def flags(self) -> list[str]:
        return [f"--{name.replace('_', '-')}" for name in self.names]

    @property
    def variables(self) -> list[str]:
        return [f"{ENV_PREFIX}{name.upper()}" for name in self.names]

    @property
    def help(self) -> str:
        return self.opt.help

    def requirement(self) -> str:
        """What the option allows, in words: the middle of every refusal."""
        opt = self.opt
        if opt.requirement:
            return opt.requirement
        if self.kind is bool:
            return "true or false"
        if opt.choices:
            return "one of " + ", ".join(opt.choices)
        noun = {int: "an integer", float: "a number", str: "a non-empty string"}[self.kind]
        if opt.minimum is not None and opt.maximum is not None:
            return f"{noun} from {_number(opt.minimum)} to {_number(opt.maximum)}"
        bounds = [
            words.format(_number(bound))
            for bound, words in (
                (opt.minimum, "of {} or more"),
                (opt.above, "above {}"),
                (opt.maximum, "of {} or less"),
                (opt.below, "below {}"),
            )
            if bound is not None
        ]
        return " and ".join([f"{noun} {bounds[0]}", *bounds[1:]]) if bounds else noun

    def refusal(self, value: object) -> OptionError:
        return OptionError(f"{self.name} must be {self.requirement()}, got {value!r}")

    def convert(self, value: object) -> Any:
        """`value` (a Python value, or a string from a flag or a variable) as the option's type, checked."""
        if value is None:
            if self.optional:
                return None
            raise self.refusal(value)
        if self.kind is bool:
            return self._to_bool(value)
        if self.kind is str:
            return self._to_str(value)
        number = self._to_number(value)
        opt = self.opt
        if (
            (opt.minimum is not None and number < opt.minimum)
            or (opt.maximum is not None and number > opt.maximum)
            or (opt.above is not None and number <= opt.above)
            or (opt.below is not None and number >= opt.below)
        ):
            raise self.refusal(number)
        return number

    def _to_bool(self, value: object) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise self.refusal(value)

    def _to_number(self, value: object) -> int | float:
        if isinstance(value, bool):  # True is an int to Python, never a count or a fraction here
            raise self.refusal(value)
        if isinstance(value, str):
            text = value.strip()
            try:
                value = int(text) if self.kind is int else float(text)
            except ValueError:
                raise self.refusal(value) from None
        if self.kind is int and isinstance(value, int):
            return value
        if self.kind is float and isinstance(value, int | float) and math.isfinite(value):
            return float(value)
        raise self.refusal(value)

    def _to_str(self, value: object) -> str:
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str) or not value or "\x00" in value:
            raise self.refusal(value)
        opt = self.opt
        if opt.choices or opt.pattern:
            pattern_match = opt.pattern is not None and re.fullmatch(opt.pattern, value)
            if value not in opt.choices and not pattern_match:
                raise self.refusal(value)
        if opt.check is not None:
            try:
                opt.check(value)
            except ValueError as exc:
                # The check's reason says what is wrong better than the requirement's words would.
                raise OptionError(f"{self.name}: {exc}") from None
        return value

    def to_text(self, value: Any) -> str:
        """`value` as a flag or a variable spells it (`convert` reads it back)."""
        if isinstance(value, bool):
            return "true" if value else "false"
        return str(value)

    def command_line(self, value: Any) -> list[str]:
        """The flags that set this option to `value` (nothing for None: the default)."""
        if value is None:
            return []
        if self.kind is bool:
            return [self.flags[0] if value else f"--no-{self.flags[0][2:]}"]
        return [self.flags[0], self.to_text(value)]


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def options_of(cls: type) -> tuple[Option, ...]:
    """The options declared on a dataclass or a pydantic model, in declaration order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    defaults = _defaults(cls)
    found = []
    for name, hint in hints.items():
        if typing.get_origin(hint) is not typing.Annotated:
            continue
        base, *extras = typing.get_args(hint)
        opts = [e for e in extras if isinstance(e, Opt)]
        if not opts:
            continue
        kind, optional = _kind(name, base)
        found.append(Option(name, kind, optional, defaults.get(name), opts[0]))
    return tuple(found)


def _defaults(cls: type) -> dict[str, Any]:
    model_fields = getattr(cls, "model_fields", None)
    if isinstance(model_fields, dict):  # pydantic
        return {name: field.default for name, field in model_fields.items()}
    fields: dict[str, Any] = getattr(cls, "__dataclass_fields__", {})
    return {name: field.default for name, field in fields.items()}


def _kind(name: str, annotation: Any) -> tuple[type, bool]:
    """(bool | int | float | str, whether None is allowed) from `T` or `T | None`."""
    args = typing.get_args(annotation)
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    optional = union and type(None) in args
    if union:
        rest = [a for a in args if a is not type(None)]
        annotation = rest[0] if len(rest) == 1 else None
    if annotation not in _KINDS:
        raise TypeError(
            f"option {name}: {annotation!r} is not bool, int, float or str (or one of them | None)"
        )
    return annotation, optional


def by_name(options: Iterable[Option]) -> dict[str, Option]:
    """Every option under its name and its old names."""
    return {name: option for option in options for name in option.names}


# --- the command line ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser | Any, options: Iterable[Option]) -> None:
    """A flag for every option (old spellings too). Unset flags are None, so what a variable or the
    default says still counts; a refused value exits 2 with the option's message."""
    for option in options:
        kwargs: dict[str, Any] = {"dest": option.name, "default": None, "help": _flag_help(option)}
        if option.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction  # --x and --no-x
        else:
            kwargs["type"] = _argparse_type(option)
            kwargs["metavar"] = option.opt.metavar or _metavar(option)
        parser.add_argument(*option.flags, **kwargs)


def _argparse_type(option: Option) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return option.convert(text)
        except OptionError as exc:  # argparse shows an ArgumentTypeError's own words
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = option.name  # what argparse calls the type in its other messages
    return convert


def _metavar(option: Option) -> str:
    if option.opt.choices:
        return "{" + ",".join(option.opt.choices) + "}"
    return {int: "N", float: "X", str: option.name.upper()}[option.kind]


def _flag_help(option: Option) -> str:
    default = option.opt.none if option.default is None else _shown(option, option.default)
    extra = f"; {option.requirement()}" if option.kind in (int, float) else ""
    old = f"; also {', '.join(option.flags[1:])}" if option.opt.aliases else ""
    words = f"{option.help} (default: {default}{extra}; env {option.variables[0]}{old})"
    return words.replace("%", "%%")  # argparse formats help with %


def values_given(args: argparse.Namespace, options: Iterable[Option]) -> dict[str, Any]:
    """The options set on the command line (an unset flag is None)."""
    return {o.name: getattr(args, o.name) for o in options if getattr(args, o.name, None) is not None}


def command_line(options: Iterable[Option], values: Mapping[str, Any]) -> list[str]:
    """The flags that pass `values` on to another loraplex command."""
    return [arg for o in options if o.name in values for arg in o.command_line(values[o.name])]


# --- the environment ----------------------------------------------------------------------------------


def from_environment(
    options: Iterable[Option], environ: Mapping[str, str], skip: Iterable[str] = ()
) -> dict[str, Any]:
    """The options set by LORAPLEX_<NAME> (or an old name's variable); empty variables count as unset.

    A refused value raises OptionError naming the variable: `LORAPLEX_MAX_NUM_SEQS=0: max_num_seqs must be
    an integer of 1 or more, got 0`. Options in `skip` (given another way, which wins) are not read."""
    skipped = set(skip)
    found: dict[str, Any] = {}
    for option in options:
        if option.name in skipped:
            continue
        present = [(v, environ[v]) for v in option.variables if environ.get(v, "").strip()]
        if not present:
            continue
        values = {}
        for variable, text in present:
            try:
                values[variable] = option.convert(text)
            except OptionError as exc:
                raise OptionError(f"{variable}={text}: {exc}") from None
        if len(set(map(repr, values.values()))) > 1:
            said = ", ".join(f"{v}={text}" for v, text in present)
            raise OptionError(f"{said}: each sets {option.name}, differently; keep one")
        found[option.name] = next(iter(values.values()))
    return found


# --- the docs -----------------------------------------------------------------------------------------


def markdown_table(options: Iterable[Option]) -> str:
    """The options as docs/configuration.md shows them: name, flag, variable, default, meaning."""
    lines = ["| option | flag | variable | default | meaning |", "|---|---|---|---|---|"]
    for o in options:
        flags = " ".join(f"`{f}`" for f in o.flags)
        variables = " ".join(f"`{v}`" for v in o.variables)
        default = o.opt.none if o.default is None else f"`{_shown(o, o.default)}`"
        allowed = "" if o.kind is str and not o.opt.choices else f" ({o.requirement()})"
        meaning = _cell(o.help + allowed)
        lines.append(f"| `{o.name}` | {flags} | {variables} | {_cell(default)} | {meaning} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """Text as a table cell shows it: `<shape>` is not an HTML tag, `|` does not end the cell."""
    return text.replace("<", "&lt;").replace("|", "\\|")


def _shown(option: Option, value: Any) -> str:
    if option.opt.unit == "bytes" and isinstance(value, int):
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value >= size and value % size == 0:
                return f"{value} ({value // size} {unit})"
    return option.to_text(value)
