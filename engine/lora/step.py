"""One step's LoRA work, as the model calls it per layer and projection group; tokens without an
adapter, and groups no adapter in the batch targets, cost nothing.

Two ways to do it. On the CPU (LoraStacker): gather the stacked A and B rows of the step's adapters
once, and mask each token's columns to its own adapter, so each group is two dense matmuls. With the
Triton kernels (KernelLoraStacker): the kernels read every adapter's rows straight from the pool through
small tables, per token for decodes and per segment (one prefill chunk, one adapter) for prefills."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..kernels import reference
from ..kernels.lora_tables import LoraTables, step_tables
from .layout import GROUPS
from .residency import AdapterResidency

if TYPE_CHECKING:
    from ..runner import StepBatch


# A group's adapters in the step (sorted names), their A^T [L, G, in, R] and B^T [L, G, R, out].
Stack = tuple[tuple[str, ...], torch.Tensor, torch.Tensor]


@dataclass
class GroupPlan:
    """One projection group's work in a step: its adapters' padded matrices and which tokens use them."""

    a: torch.Tensor  # [L, G, in, R] A^T of the G adapters that adapt the group, ranks padded to R
    b: torch.Tensor  # [L, G, R, out] scaled B^T
    order: torch.Tensor | None  # [T_a] rows of their tokens grouped by adapter (None: all rows, in order)
    offsets: torch.Tensor  # [G] int32 row ends within order
    counts: list[int]


class LoraStep:
    def __init__(self, plans: dict[str, GroupPlan]):
        self.plans = plans

    def __call__(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        plan = self.plans.get(group)
        if plan is not None:
            reference.lora_grouped(x, y, plan.a[layer], plan.b[layer], plan.order, plan.offsets, plan.counts)


class LoraStacker:
    """Builds LoraSteps for the CPU path. Each adapter's rows are gathered from the pool into padded
    per-adapter matrices once per set of adapters and reused while the same adapters stay in the same
    pages (the set is keyed sorted, so decode steps with the same adapters reuse it in any order)."""

    def __init__(self, residency: AdapterResidency):
        self.residency = residency
        self._cached_key: tuple[tuple[str, ...], int] | None = None
        self._cached: dict[str, Stack] = {}

    def build(self, batch: StepBatch) -> LoraStep | None:
        return self.build_for(batch.token_adapters)

    def build_for(self, token_adapters: Sequence[str | None]) -> LoraStep | None:
        names = tuple(sorted({a for a in token_adapters if a is not None}))
        if not names:
            return None
        device = self.residency.pool_rows.device
        plans: dict[str, GroupPlan] = {}
        for group, (members, a, b) in self._stacks(names).items():
            slot = {name: i for i, name in enumerate(members)}
            tokens = [(slot[n], t) for t, n in enumerate(token_adapters) if n in slot]
            tokens.sort()  # by adapter, then position: each adapter's tokens form one block
            counts = [0] * len(members)
            for s, _ in tokens:
                counts[s] += 1
            rows = [t for _, t in tokens]
            in_order = len(rows) == len(token_adapters) and rows == list(range(len(rows)))
            order = None if in_order else torch.tensor(rows, dtype=torch.long, device=device)
            ends = torch.tensor(counts, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
            keep = [i for i, c in enumerate(counts) if c]  # members absent from this step's tokens
            if len(keep) < len(members):
                a, b, ends = a[:, keep], b[:, keep], ends[keep]
                counts = [counts[i] for i in keep]
            plans[group] = GroupPlan(a, b, order, ends, counts)
        return LoraStep(plans)

    def _stacks(
        self, names: tuple[str, ...]
    ) -> dict[str, tuple[tuple[str, ...], torch.Tensor, torch.Tensor]]:
        key = (names, self.residency.version)
        if key == self._cached_key:
            return self._cached
        pool_rows = self.residency.pool_rows
        resident = self.residency.resident
        stacks: dict[str, Stack] = {}
        for group in GROUPS:
            members = tuple(n for n in names if group in resident[n].a_rows)
            if not members:
                continue
            a_parts = [reference.gather_rows(pool_rows, resident[n].a_rows[group]) for n in members]
            b_parts = [reference.gather_rows(pool_rows, resident[n].b_rows[group]) for n in members]
            layers, _, width_in = a_parts[0].shape
            width_out = b_parts[0].shape[2]
            # Padded to a multiple of 8 rows: grouped GEMMs want 16-byte strides in half precision.
            rank = -(-max(p.shape[1] for p in a_parts) // 8) * 8
            a = pool_rows.new_zeros(layers, len(members), width_in, rank)
            b = pool_rows.new_zeros(layers, len(members), rank, width_out)
            for i, (pa, pb) in enumerate(zip(a_parts, b_parts, strict=True)):
                a[:, i, :, : pa.shape[1]] = pa.transpose(1, 2)
                b[:, i, : pb.shape[1]] = pb
            stacks[group] = (members, a, b)
        self._cached_key, self._cached = key, stacks
        return stacks


class KernelLoraStep:
    """Calls the Triton shrink and expand kernels: per token on the decode rows [0, D), per segment on
    the prefill rows [D, T)."""

    def __init__(
        self,
        pool_rows: torch.Tensor,
        tables: dict[str, LoraTables],
        num_decodes: int,
        decode_slots: torch.Tensor | None,  # [D] int32 slot of each decode row (-1: none); None: no LoRA
        segments: tuple[torch.Tensor, torch.Tensor, int] | None,  # seg_starts [G+1], seg_slot [G], longest
    ):
        from ..kernels import lora_expand, lora_shrink

        self._shrink, self._expand = lora_shrink, lora_expand
        self.pool_rows = pool_rows
        self.tables = tables
        self.num_decodes = num_decodes
        self.decode_slots = decode_slots
        self.segments = segments

    def __call__(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        t = self.tables.get(group)
        if t is None:
            return
        a, b, cols, widths = t.a_starts[layer], t.b_starts[layer], t.b_cols[layer], t.b_widths[layer]
        pool, d = self.pool_rows, self.num_decodes
        if self.decode_slots is not None:
            slots = self.decode_slots
            shrunk = self._shrink.lora_shrink_tokens(
                x[:d], pool, a, t.slot_start, t.slot_rank, slots, t.max_rank
            )
            self._expand.lora_expand_tokens(
                y[:d], shrunk, pool, b, cols, widths, t.slot_start, t.slot_rank, slots
            )
        if self.segments is not None:
            starts, seg_slot, longest = self.segments
            shrunk = self._shrink.lora_shrink_segments(
                x[d:], pool, a, t.slot_start, t.slot_rank, starts, seg_slot, t.max_rank, longest
            )
            self._expand.lora_expand_segments(
                y[d:], shrunk, pool, b, cols, widths, t.slot_start, t.slot_rank, starts, seg_slot, longest
            )


class KernelLoraStacker:
    """Builds KernelLoraSteps; the tables are made once per set of adapters and reused while the same
    adapters run in the same pages."""

    def __init__(self, residency: AdapterResidency):
        self.residency = residency
        self._cached_key: tuple[tuple[str, ...], int] | None = None
        self._cached: dict[str, LoraTables] = {}

    def build(self, batch: StepBatch) -> KernelLoraStep | None:
        adapters = batch.token_adapters
        names = tuple(dict.fromkeys(a for a in adapters if a is not None))
        if not names:
            return None
        slot = {name: i for i, name in enumerate(names)}
        device = self.residency.pool_rows.device
        d = batch.num_decodes
        decode = [slot[a] if a is not None else -1 for a in adapters[:d]]
        decode_slots = (
            torch.tensor(decode, dtype=torch.int32, device=device) if any(s >= 0 for s in decode) else None
        )
        segments = None
        seg_adapters = [adapters[seg.start] for seg in batch.prefills]
        seg_slots = [slot[a] if a is not None else -1 for a in seg_adapters]
        if any(s >= 0 for s in seg_slots):
            starts = [seg.start - d for seg in batch.prefills] + [batch.prefills[-1].end - d]
            segments = (
                torch.tensor(starts, dtype=torch.int32, device=device),
                torch.tensor(seg_slots, dtype=torch.int32, device=device),
                max(seg.end - seg.start for seg in batch.prefills),
            )
        return KernelLoraStep(self.residency.pool_rows, self._tables(names), d, decode_slots, segments)

    def _tables(self, names: tuple[str, ...]) -> dict[str, LoraTables]:
        key = (names, self.residency.version)
        if key != self._cached_key:
            residency = self.residency
            resident = [residency.resident[name] for name in names]
            self._cached = step_tables(resident, residency.base, residency.head_dim)
            self._cached_key = key
        return self._cached
