"""What an InferenceDeployment may add to the engine's command line and its LORAPLEX_* environment.

`spec.engine.extraArgs` is parsed by `loraplex serve`'s own parser (cli/serve_args.py), with abbreviations
off as the engine has them: `--por 9000` is refused as unknown rather than read as `--port 9000`, a value
the engine would refuse is refused here (an InvalidSpec condition instead of a crash-looping pod), and
the options the operator sets itself are refused by name whatever their spelling (`--pool-fraction` is
`--gpu-memory-fraction`). The same options are refused as LORAPLEX_* variables in `spec.podTemplate`:
where the operator passes no flag (`--host`, `--quantization` when none), a variable would win.
Pure: `check_extra_args` raises ExtraArgsError.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from functools import cache
from typing import NoReturn

from loraplex.cli.serve_args import add_serve_arguments
from loraplex.engine.options import ENV_PREFIX
from loraplex.engine.server.settings import ALL_OPTIONS

# Options the operator sets, as flags (operator/resources.py engine_args) or through its ConfigMap, and
# `--host` (the Service, probes and NetworkPolicy need the default, every interface).
# tests/operator/test_engine_args.py keeps this in step with resources.py.
OPERATOR_OPTIONS = frozenset(
    {
        "model",
        "dtype",
        "quantization",
        "port",
        "host",
        "device",
        "gpu_memory_fraction",
        "max_resident_adapters",
        "max_batch_tokens",
        "model_cache",
        "adapter_store",
        "s3_endpoint_url",
    }
)
# Variables the engine reads besides its options' (engine/server/settings.py, engine/server/serve.py).
ENGINE_EXTRA_VARIABLES = frozenset({f"{ENV_PREFIX}ADAPTERS", f"{ENV_PREFIX}TERMINATION_LOG"})
WHERE = "spec.engine.extraArgs"


class ExtraArgsError(ValueError):
    """extraArgs the engine would refuse, or that set what the operator owns."""


class _RefusingParser(argparse.ArgumentParser):
    """argparse's parser, raising instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ExtraArgsError(message)


@cache
def serve_parser() -> argparse.ArgumentParser:
    # add_help=False: `--help` would print and stop the engine; it is refused as unknown instead.
    parser = _RefusingParser(prog="loraplex serve", allow_abbrev=False, add_help=False)
    add_serve_arguments(parser)
    return parser


def check_extra_args(args: Sequence[str]) -> None:
    """Nothing when `loraplex serve <operator flags> *args` reads only options the CR may set."""
    for arg in args:
        if "$(" in arg:
            # The kubelet expands $(VAR) in args from the container's env, which podTemplate can set: what
            # is checked here would not be what the engine reads.
            raise ExtraArgsError(
                f"{WHERE} {arg[:100]!r} contains $(...), which Kubernetes replaces with a variable's value; "
                "write the value itself"
            )
    try:
        given = serve_parser().parse_args(list(args))
    except ExtraArgsError as error:
        raise ExtraArgsError(f"{WHERE} is refused by `loraplex serve`: {error}") from None
    owned = sorted(name for name in OPERATOR_OPTIONS if getattr(given, name, None) is not None)
    if owned:
        flags = ", ".join(_flag(name) for name in owned)
        raise ExtraArgsError(
            f"{WHERE} sets {flags}, which the operator sets itself from the spec (spec.model, "
            "spec.resources, spec.engine, spec.adapterStore, port 8000 on every interface); remove it"
        )


def operator_variables() -> frozenset[str]:
    """Every LORAPLEX_* variable of an option the operator sets (old names included)."""
    return frozenset(v for o in ALL_OPTIONS if o.name in OPERATOR_OPTIONS for v in o.variables)


def engine_variables() -> frozenset[str]:
    """Every LORAPLEX_* variable the engine reads and a CR may set."""
    options = {v for o in ALL_OPTIONS if o.name not in OPERATOR_OPTIONS for v in o.variables}
    return frozenset(options | ENGINE_EXTRA_VARIABLES)


def _flag(name: str) -> str:
    return next(o.flags[0] for o in ALL_OPTIONS if o.name == name)
