"""The flags of `loraplex serve`, declared once for the command and for the operator that checks them.

The operator parses an InferenceDeployment's `spec.engine.extraArgs` with this very parser (abbreviations
off, as the engine's own parser has them), so what it refuses is exactly what the engine would read: no
copy of the flag list to drift, and `--por 9000` is neither `--port` here nor there.
"""

from __future__ import annotations

import argparse
from typing import Any

# The options' declarations (no torch, no FastAPI).
from loraplex.engine.config import ENGINE_OPTIONS
from loraplex.engine.options import add_arguments
from loraplex.engine.server.settings import SERVER_OPTIONS


def add_serve_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """Every `loraplex serve` flag onto `parser` (which must have allow_abbrev=False)."""
    parser.add_argument(
        "--adapter",
        action="append",
        default=None,
        metavar="NAME=PATH_OR_URI",
        help="register an adapter at start, optionally NAME=URI@SHA256 (repeatable; env LORAPLEX_ADAPTERS "
        "as a JSON list)",
    )
    add_arguments(parser.add_argument_group("server options"), SERVER_OPTIONS)
    add_arguments(parser.add_argument_group("engine options"), ENGINE_OPTIONS)
