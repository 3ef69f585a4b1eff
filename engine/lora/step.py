"""One step's LoRA work, as the model calls it per layer and projection group; tokens without an
adapter, and groups no adapter in the batch targets, cost nothing.

Two ways to do it. On the CPU (LoraStacker): gather each of the step's adapters' rows from the pool into
rank-padded matrices, group the tokens by adapter, and run two grouped GEMMs per projection group. With
the Triton kernels (KernelLoraStacker): the kernels read every adapter's rows straight from the pool
through small tables, per token for decodes and per segment (one prefill chunk, one adapter) for
prefills. Both derive what they need once per set of adapters (keyed sorted, so steps with the same
adapters in another order reuse it) and again only when an adapter's pages change."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

from ..kernels import reference
from ..kernels.lora_tables import LoraTables, step_tables
from .layout import GROUPS
from .residency import AdapterResidency

if TYPE_CHECKING:
    from ..runner import StepBatch


# A group's adapters in the step (sorted names), their A^T [L, G, in, R] and B^T [L, G, R, out].
Stack = tuple[tuple[str, ...], torch.Tensor, torch.Tensor]
Derived = TypeVar("Derived")


def adapter_set(token_adapters: Sequence[str | None]) -> tuple[str, ...]:
    """The step's adapters, sorted: the same set gives the same slots whatever the tokens' order."""
    return tuple(sorted({a for a in token_adapters if a is not None}))


class _PerAdapterSet(Generic[Derived]):
    """What a stacker derives from a set of resident adapters, rebuilt only when the set changes or
    the residency's version does (an adapter's pages moved)."""

    def __init__(self, residency: AdapterResidency, derive: Callable[[tuple[str, ...]], Derived]):
        self.residency = residency
        self.derive = derive
        self._key: tuple[tuple[str, ...], int] | None = None
        self._value: Derived | None = None

    def __call__(self, names: tuple[str, ...]) -> Derived:
        key = (names, self.residency.version)
        if key != self._key or self._value is None:
            self._value, self._key = self.derive(names), key
        return self._value


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
    """Builds LoraSteps for the CPU path."""

    def __init__(self, residency: AdapterResidency):
        self.residency = residency
        self._stacks = _PerAdapterSet(residency, self._gather)

    def build(self, batch: StepBatch) -> LoraStep | None:
        adapters = batch.token_adapters
        names = adapter_set(adapters)
        if not names:
            return None
        # The tokens of each adapter, in adapter order: one block per adapter for the grouped GEMMs.
        by_adapter: dict[str, list[int]] = {name: [] for name in names}
        for row, name in enumerate(adapters):
            if name is not None:
                by_adapter[name].append(row)
        device = self.residency.pool_rows.device
        plans: dict[str, GroupPlan] = {}
        for group, (members, a, b) in self._stacks(names).items():
            counts = [len(by_adapter[n]) for n in members]  # each at least 1: members are in the step
            rows = [row for n in members for row in by_adapter[n]]
            in_order = len(rows) == len(adapters) and rows == list(range(len(rows)))
            order = None if in_order else torch.tensor(rows, dtype=torch.long, device=device)
            ends = torch.tensor(counts, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
            plans[group] = GroupPlan(a, b, order, ends, counts)
        return LoraStep(plans)

    def _gather(self, names: tuple[str, ...]) -> dict[str, Stack]:
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
    """Builds KernelLoraSteps for the Triton kernels."""

    def __init__(self, residency: AdapterResidency):
        self.residency = residency
        self._tables = _PerAdapterSet(
            residency,
            lambda names: step_tables(
                [residency.resident[n] for n in names], residency.base, residency.head_dim
            ),
        )

    def build(self, batch: StepBatch) -> KernelLoraStep | None:
        adapters = batch.token_adapters
        names = adapter_set(adapters)
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
