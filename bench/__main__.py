"""`python -m loraplex.bench <benchmark>`: benchmarks that print their figures."""

from __future__ import annotations

import argparse
import sys

from . import (
    clients,
    cluster,
    fairness,
    grammar,
    kernels,
    lora,
    lora_tables,
    offline,
    prefix,
    quant,
    sampling,
    serve,
    spec,
    step,
    step_profile,
)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m loraplex.bench")
    commands = parser.add_subparsers(dest="command", required=True)
    offline.add_arguments(commands.add_parser("offline", help="engine vs transformers throughput"))
    step_profile.add_arguments(commands.add_parser("profile", help="where a decode step's time goes"))
    serve.add_arguments(commands.add_parser("serve", help="loraplex serve under streaming load on loopback"))
    lora.add_arguments(commands.add_parser("lora", help="multi-LoRA benchmarks (issue 3)"))
    step.add_arguments(commands.add_parser("step", help="a decode step's time against its counted floor"))
    kernels.add_arguments(
        commands.add_parser("kernels", help="the Triton kernels vs floors and torch baselines")
    )
    fairness.add_arguments(
        commands.add_parser("fairness", help="B's TTFT beside a flooding tenant (issue 18)")
    )
    prefix.add_arguments(commands.add_parser("prefix", help="4-turn chats with and without the prefix cache"))
    sampling.add_arguments(commands.add_parser("sampling", help="per-row vs batched sampling (issue 16)"))
    lora_tables.add_arguments(
        commands.add_parser("lora-tables", help="LoRA tables per adapter set (issue 16)")
    )
    quant.add_arguments(commands.add_parser("quant", help="float32/bf16/int8/int4 vs llama.cpp (issue 19)"))
    cluster.add_arguments(
        commands.add_parser("cluster", help="placement and routing policies on simulated pods (issue 26)")
    )
    clients.add_arguments(
        commands.add_parser("clients", help="guidellm and inference-perf against loraplex up (issue 27)")
    )
    grammar.add_arguments(
        commands.add_parser("grammar", help="structured decoding's mask cost per token (issue 27)")
    )
    spec.add_arguments(
        commands.add_parser("spec", help="prompt-lookup speculative decoding at one stream (issue 30)")
    )
    args = parser.parse_args()
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
