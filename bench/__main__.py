"""`python -m loraplex.bench <benchmark>`: benchmarks that print their figures."""

from __future__ import annotations

import argparse
import sys

from . import offline


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m loraplex.bench")
    commands = parser.add_subparsers(dest="command", required=True)
    offline.add_arguments(
        commands.add_parser("offline", help=offline.__doc__.splitlines()[0] if offline.__doc__ else "")
    )
    args = parser.parse_args()
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
