"""`python -m loraplex.bench <benchmark>`: benchmarks that print their figures."""

from __future__ import annotations

import argparse
import sys

from . import offline, step_profile


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m loraplex.bench")
    commands = parser.add_subparsers(dest="command", required=True)
    offline.add_arguments(commands.add_parser("offline", help="engine vs transformers throughput"))
    step_profile.add_arguments(commands.add_parser("profile", help="where a decode step's time goes"))
    args = parser.parse_args()
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
