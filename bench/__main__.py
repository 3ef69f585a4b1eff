"""`python -m loraplex.bench <benchmark>`: benchmarks that print their figures."""

from __future__ import annotations

import argparse
import sys

from . import kernels, lora, offline, serve, step_profile


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m loraplex.bench")
    commands = parser.add_subparsers(dest="command", required=True)
    offline.add_arguments(commands.add_parser("offline", help="engine vs transformers throughput"))
    step_profile.add_arguments(commands.add_parser("profile", help="where a decode step's time goes"))
    serve.add_arguments(commands.add_parser("serve", help="loraplex serve under streaming load on loopback"))
    lora.add_arguments(commands.add_parser("lora", help="multi-LoRA benchmarks (issue 3)"))
    kernels.add_arguments(
        commands.add_parser("kernels", help="the Triton kernels vs floors and torch baselines")
    )
    args = parser.parse_args()
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
