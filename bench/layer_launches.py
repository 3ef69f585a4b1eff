"""Kernel launches of a decode step per decoder layer, before and after the fused layer kernels.

`python -m loraplex.bench.layer_launches` runs one decode step of a SmolLM2-shaped model (random
weights, a small vocabulary) three ways under the dispatch counter (bench/dispatch.py: aten ops that
are not views, plus Triton launches), with 1 and 2 layers so the per-layer figure is the difference:

- reference: the plain-torch CPU path;
- kernels, unfused: Triton attention and KV write with the torch norms, rotary and activation (the
  kernel path before engine/model/layer_ops.py);
- kernels, fused: the kernel path as the runner runs it now.

The Triton kernels run in the interpreter (TRITON_INTERPRET=1 is set here), which counts launches as a
GPU would make them; no LoRA, so what is left is the layer's own work.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from dataclasses import dataclass, replace

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch


@dataclass
class _Request:
    pages: list[int]
    adapter: str | None = None

    def tokens(self, start: int, end: int) -> list[int]:
        return [1] * (end - start)


@dataclass
class _Decode:
    request: _Request
    start: int
    num_tokens: int = 1
    samples: bool = True

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class _Unfused:
    """The Triton attention without its layer ops: the model runs its torch norms and rotary beside it."""

    def __init__(self, inner: object):
        self.inner = inner

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.inner(layer, q, k, v)  # type: ignore[operator]


# Ops that only allocate: the caching allocator hands memory out on the host, no kernel runs.
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty"}


def count_step(layers: int, batch: int, context: int, path: str, dtype: torch.dtype) -> Counter[str]:
    """Ops by name of one decode step of `batch` sequences at `context` tokens each."""
    from loraplex.engine.attention import ReferenceAttention, TritonAttention
    from loraplex.engine.batch import BatchBuilder
    from loraplex.engine.model.config import NAMED_SHAPES
    from loraplex.engine.model.loader import random_model

    from .dispatch import DispatchCounter

    config = replace(NAMED_SHAPES["smollm2-135m"], num_layers=layers, vocab_size=512)
    model = random_model(config, dtype, "cpu", max_positions=context + 1)
    page_size = 16
    per_seq = -(-context // page_size)
    chunks = [
        _Decode(_Request(list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))), context - 1)
        for i in range(batch)
    ]
    memory = torch.zeros(
        1 + batch * per_seq, layers, 2, config.num_kv_heads, page_size, config.head_dim, dtype=dtype
    )
    step = BatchBuilder(page_size, torch.device("cpu")).build(chunks)
    scale = config.head_dim**-0.5
    attention: object
    if path == "reference":
        attention = ReferenceAttention(memory, step, scale)
    elif path == "unfused":
        attention = _Unfused(TritonAttention(memory, step, scale))
    else:
        attention = TritonAttention(memory, step, scale)
    # no_grad, not inference_mode: under inference_mode the dispatch mode does not see dtype casts.
    with torch.no_grad():
        model(step.input_ids, step.positions, attention, step.logits_indices)  # compile / warm
        with DispatchCounter() as trace:
            model(step.input_ids, step.positions, attention, step.logits_indices)
    return trace.by_name()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=40)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--detail", action="store_true", help="list the ops of one layer by name")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    dtype = getattr(torch, args.dtype)
    print(f"decode step, SmolLM2 shapes, batch {args.batch}, context {args.context}, {args.dtype}, no LoRA")
    print("ops counted (kernels + allocations): per layer, rest of the step")
    print(f"{'path':<18}{'kernels/layer':>14}{'allocs/layer':>13}{'kernels/rest':>13}{'allocs/rest':>12}")
    for path, label in (
        ("reference", "reference (CPU)"),
        ("unfused", "kernels, unfused"),
        ("fused", "kernels, fused"),
    ):
        one, two = (count_step(n, args.batch, args.context, path, dtype) for n in (1, 2))
        layer = two - one
        rest = one - layer
        allocs = [sum(n for name, n in c.items() if name in ALLOCATIONS) for c in (layer, rest)]
        print(
            f"{label:<18}{layer.total() - allocs[0]:>14}{allocs[0]:>13}"
            f"{rest.total() - allocs[1]:>13}{allocs[1]:>12}"
        )
        if args.detail:
            print("    " + ", ".join(f"{name} {n}" for name, n in sorted(layer.items())))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m loraplex.bench.layer_launches")
    add_arguments(parser)
    args = parser.parse_args()
    return int(args.run(args))


if __name__ == "__main__":
    raise SystemExit(main())
