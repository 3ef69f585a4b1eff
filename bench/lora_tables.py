"""What building the LoRA kernels' tables costs when the step's adapter set changes (issue 16): the
former builder (kept here as the baseline and as the oracle of tests/engine/kernels/test_lora_tables.py)
concatenated every adapter's full index tensors per step; the persistent tables (engine/lora/tables.py)
write each adapter's metadata once at load and give a step only its slot starts and ranks.

    python -m loraplex.bench lora-tables [--adapters 64] [--rank 16] [--repeats 5]

Bytes are those of every tensor the ops allocate (counted under a dispatch mode); Llama-2-7B's shape
(32 layers, head_dim 128), q/k/v/o/gate/up/down adapted.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from loraplex.adapters import BaseShape
from loraplex.engine.lora.layout import GROUPS, NULL_ROW, group_width
from loraplex.engine.lora.tables import AdapterRows, LoraTables, ResidentTables, adapter_meta

LLAMA2_7B = BaseShape(num_layers=32, hidden_size=4096, intermediate_size=11008, q_size=4096, kv_size=4096)
HEAD_DIM = 128


def old_group_tables(
    adapters: Sequence[AdapterRows], group: str, base: BaseShape, head_dim: int
) -> LoraTables | None:
    """The builder the engine used before issue 16, verbatim: every step concatenated the step's
    adapters' full index tensors to read one column of A and a few of B."""
    ranks = [a.a_rows[group].shape[1] if group in a.a_rows else 0 for a in adapters]
    present = [a for a in adapters if group in a.a_rows]
    if not present:
        return None
    a_index = torch.cat([a.a_rows[group] for a in present], dim=1)  # [L, C, in / head_dim]
    b_index = torch.cat([a.b_rows[group] for a in present], dim=1)  # [L, C, out / head_dim]
    b_starts = torch.zeros(b_index.shape[:2], dtype=torch.long, device=b_index.device)
    b_cols = torch.zeros(b_index.shape[:2], dtype=torch.int32, device=b_index.device)
    b_widths = torch.zeros(b_index.shape[:2], dtype=torch.int32, device=b_index.device)
    column = 0
    for module in GROUPS[group]:
        width = base.features(module)[1]
        first = b_index[:, :, column // head_dim]
        owns = first != NULL_ROW
        b_starts = torch.where(owns, first, b_starts)
        b_cols.masked_fill_(owns, column)
        b_widths.masked_fill_(owns, width)
        column += width
    starts = [0]
    for rank in ranks[:-1]:
        starts.append(starts[-1] + rank)
    device = a_index.device
    return LoraTables(
        a_starts=a_index[:, :, 0].contiguous(),
        b_starts=b_starts,
        b_cols=b_cols,
        b_widths=b_widths,
        slot_start=torch.tensor(starts, dtype=torch.int32, device=device),
        slot_rank=torch.tensor(ranks, dtype=torch.int32, device=device),
        max_rank=max(ranks),
    )


def old_step_tables(adapters: Sequence[AdapterRows], base: BaseShape, head_dim: int) -> dict[str, LoraTables]:
    tables = {group: old_group_tables(adapters, group, base, head_dim) for group in GROUPS}
    return {group: table for group, table in tables.items() if table is not None}


@dataclass
class SyntheticRows:
    """Index tensors shaped as layout.py packs a rank-r adapter of every module (pool rows made up)."""

    a_rows: dict[str, torch.Tensor]
    b_rows: dict[str, torch.Tensor]


def synthetic_rows(base: BaseShape, rank: int, first_row: int) -> SyntheticRows:
    a_rows, b_rows = {}, {}
    row = first_row
    for group, modules in GROUPS.items():
        width_in, width_out = (w // HEAD_DIM for w in group_width(base, group))
        stacked = rank * len(modules)
        a = torch.arange(row, row + base.num_layers * stacked * width_in).view(
            base.num_layers, stacked, width_in
        )
        row += a.numel()
        b = torch.full((base.num_layers, stacked, width_out), NULL_ROW, dtype=torch.long)
        column = 0
        for m, module in enumerate(modules):
            width = base.features(module)[1] // HEAD_DIM
            block = torch.arange(row, row + base.num_layers * rank * width).view(base.num_layers, rank, width)
            b[:, m * rank : (m + 1) * rank, column : column + width] = block
            row += block.numel()
            column += width
        a_rows[group], b_rows[group] = a, b
    return SyntheticRows(a_rows, b_rows)


class _Allocations(TorchDispatchMode):
    """Sums the bytes of every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.bytes += sum(
            t.untyped_storage().nbytes()
            for t in tree_leaves(out)
            if isinstance(t, torch.Tensor) and t._base is None and not func.is_view
        )
        return out


def _measure(build: Callable[[], object], repeats: int) -> tuple[float, int]:
    with _Allocations() as counted:
        build()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        build()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), counted.bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--adapters", type=int, default=64, help="adapters in the step")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    base = LLAMA2_7B
    adapters = []
    row = 1
    for _ in range(args.adapters):
        adapters.append(synthetic_rows(base, args.rank, row))
        row += 10_000_000
    names = [f"a{i}" for i in range(args.adapters)]
    resident = ResidentTables(base.num_layers, torch.device("cpu"))
    began = time.perf_counter()
    for name, adapter in zip(names, adapters, strict=True):
        resident.add(name, adapter_meta(adapter, base, HEAD_DIM))
    load_ms = (time.perf_counter() - began) * 1e3 / args.adapters
    old_ms, old_bytes = _measure(lambda: old_step_tables(adapters, base, HEAD_DIM), args.repeats)
    new_ms, new_bytes = _measure(lambda: resident.step_tables(names), args.repeats)
    print(
        f"LoRA tables for a new adapter set: {args.adapters} adapters of rank {args.rank}, Llama-2-7B shape, "
        f"all 7 modules, CPU, median of {args.repeats}"
    )
    print(f"{'':<28}{'ms':>10}{'bytes allocated':>18}")
    print(f"{'old: concatenate per step':<28}{old_ms:>10.2f}{old_bytes:>18,}")
    print(f"{'new: persistent tables':<28}{new_ms:>10.2f}{new_bytes:>18,}")
    print(f"metadata written once per adapter load: {load_ms:.2f} ms per adapter")
    return 0
