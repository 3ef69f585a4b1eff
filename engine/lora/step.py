"""One step's LoRA work, as the model calls it per layer and projection group; tokens without an
adapter, and groups no adapter in the batch targets, cost nothing.

Two ways to do it. On the CPU (LoraStacker): gather each of the step's adapters' rows from the pool into
rank-padded matrices, group the tokens by adapter, and run two grouped GEMMs per projection group. With
the Triton kernels (KernelLoraStacker): the kernels read every adapter's rows straight from the pool
through the persistent tables written when each adapter was loaded (lora/tables.py), per token for
decodes and per segment (one prefill chunk, one adapter) for prefills; a set of adapters adds only its
slot starts and ranks. Both derive what they need once per set of adapters (keyed sorted, so steps with
the same adapters in another order reuse it) and again only when an adapter's pages change; what changes
every step (which rows use which adapter) comes from the batch's metadata (engine/batch.py), already on
the device: building a step's LoRA work copies nothing from the host."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import accumulate
from typing import Generic, Protocol, TypeVar

import torch

from loraplex.adapters import BaseShape

from ..batch import LoraBatch, LoraSegments, StepBatch
from ..kernels import reference
from ..kernels.lora_meta import LoRAKernelMeta
from .layout import GROUPS, group_width
from .tables import AdapterRows, LoraTables, ResidentTables


class ResidentAdapters(Protocol):
    """What the stackers read of the adapters resident in the pool (the loader's, engine/lora/loader.py)."""

    @property
    def version(self) -> int: ...  # changes whenever an adapter's pages change

    @property
    def pool_rows(self) -> torch.Tensor: ...  # [num_pages * rows_per_page, head_dim] view of the pool

    @property
    def resident(self) -> Mapping[str, AdapterRows]: ...  # name -> its pool rows per group

    @property
    def tables(self) -> ResidentTables: ...  # the kernels' persistent tables of the resident adapters

    @property
    def base(self) -> BaseShape: ...

    @property
    def head_dim(self) -> int: ...


@dataclass
class Stack:
    """One group's matrices for a set of adapters: those of the set that adapt the group."""

    slots: tuple[int, ...]  # their slots in the set (ascending)
    a: torch.Tensor  # [L, G, in, R] A^T, ranks zero-padded to R
    b: torch.Tensor  # [L, G, R, out] scaled B^T
    slots_device: torch.Tensor  # [G] int64 the slots again, to pick their row counts on the device
    scale: torch.Tensor | None = None  # [L, G, out] DoRA g - 1 (0 for plain adapters); None: no DoRA


Derived = TypeVar("Derived")


class _PerAdapterSet(Generic[Derived]):
    """What a stacker derives from a set of resident adapters, rebuilt only when the set changes or
    the residency's version does (an adapter's pages moved)."""

    def __init__(self, residency: ResidentAdapters, derive: Callable[[tuple[str, ...]], Derived]):
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
    # [T_a] each row's adapter (0..G-1) when the rows are few per adapter (reference.lora_grouped)
    row_groups: torch.Tensor | None = None
    scale: torch.Tensor | None = None  # [L, G, out] DoRA g - 1 (Stack.scale)


class LoraStep:
    def __init__(self, plans: dict[str, GroupPlan]):
        self.plans = plans

    def __call__(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        plan = self.plans.get(group)
        if plan is not None:
            scale = None if plan.scale is None else plan.scale[layer]
            reference.lora_grouped(
                x, y, plan.a[layer], plan.b[layer], plan.order, plan.offsets, plan.counts, plan.row_groups,
                scale,
            )  # fmt: skip


class LoraStacker:
    """Builds LoraSteps for the CPU path."""

    def __init__(self, residency: ResidentAdapters):
        self.residency = residency
        self._stacks = _PerAdapterSet(residency, self._gather)
        # The stacks' dtype: on the CPU, 16-bit matrices this small multiply 3-4x slower than float32
        # ones (bench quant, 16 streams + 8 adapters), so they are widened once per adapter set.
        pool = residency.pool_rows
        widen = pool.device.type == "cpu" and pool.dtype in (torch.bfloat16, torch.float16)
        self.dtype = torch.float32 if widen else pool.dtype

    def build(self, batch: StepBatch) -> LoraStep | None:
        lora = batch.lora
        if lora is None:
            return None
        plans: dict[str, GroupPlan] = {}
        for group, stack in self._stacks(lora.adapters).items():
            plans[group] = _group_plan(lora, stack)
        return LoraStep(plans)

    def stacks(self, names: tuple[str, ...]) -> dict[str, Stack]:
        """The set's stacks by group (only the groups some of them adapt): the same dict object until
        the set or the residency's version changes."""
        return self._stacks(names)

    def widths(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each group's fused matmul."""
        return {group: group_width(self.residency.base, group) for group in GROUPS}

    def _gather(self, names: tuple[str, ...]) -> dict[str, Stack]:
        pool_rows = self.residency.pool_rows
        resident = self.residency.resident
        stacks: dict[str, Stack] = {}
        for group in GROUPS:
            slots = tuple(u for u, n in enumerate(names) if group in resident[n].a_rows)
            if not slots:
                continue
            members = [resident[names[u]] for u in slots]
            a_parts = [reference.gather_rows(pool_rows, m.a_rows[group]) for m in members]
            b_parts = [reference.gather_rows(pool_rows, m.b_rows[group]) for m in members]
            layers, _, width_in = a_parts[0].shape
            width_out = b_parts[0].shape[2]
            # Padded to a multiple of 8 rows: grouped GEMMs want 16-byte strides in half precision.
            rank = -(-max(p.shape[1] for p in a_parts) // 8) * 8
            a = pool_rows.new_zeros(layers, len(slots), width_in, rank, dtype=self.dtype)
            b = pool_rows.new_zeros(layers, len(slots), rank, width_out, dtype=self.dtype)
            for i, (pa, pb) in enumerate(zip(a_parts, b_parts, strict=True)):
                a[:, i, :, : pa.shape[1]] = pa.transpose(1, 2)
                b[:, i, : pb.shape[1]] = pb
            slots_device = torch.tensor(slots, dtype=torch.long, device=pool_rows.device)
            scale = None
            d_rows = [getattr(m, "d_rows", {}).get(group) for m in members]  # DoRA adapters have them
            if any(d is not None for d in d_rows):  # every member's g - 1 (0: a plain LoRA adapter)
                scale = pool_rows.new_zeros(layers, len(slots), width_out, dtype=self.dtype)
                for i, d in enumerate(d_rows):
                    if d is not None:
                        scale[:, i] = reference.gather_rows(pool_rows, d)
            stacks[group] = Stack(slots, a, b, slots_device, scale)
        return stacks


# Rows per adapter at or below which each row takes its own matrices (a batched matmul over rows)
# rather than a grouped GEMM per adapter: decode steps have one or two.
ROWS_PER_ADAPTER_FOR_BATCHED_ROWS = 4


def _grouped_rows(lora: LoraBatch, stack: Stack) -> GroupPlan:
    """The rows of a group's adapters, grouped by adapter, from the batch's rows grouped by slot."""
    if len(stack.slots) == len(lora.adapters):  # every adapter of the step adapts this group
        order = None if lora.in_row_order else lora.order
        return GroupPlan(stack.a, stack.b, order, lora.slot_ends, lora.slot_counts)
    # Some adapters do not adapt it: their slots' blocks of `order` drop out (views, then one cat on
    # the device), and the row ends follow from the kept slots' counts, also on the device.
    begins = [0, *accumulate(lora.slot_counts)]
    blocks = [lora.order[begins[u] : begins[u + 1]] for u in stack.slots]
    order = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    offsets = lora.slot_counts_device.index_select(0, stack.slots_device).cumsum(0, dtype=torch.int32)
    return GroupPlan(stack.a, stack.b, order, offsets, [lora.slot_counts[u] for u in stack.slots])


def _group_plan(lora: LoraBatch, stack: Stack) -> GroupPlan:
    """The group's plan; when its rows are few per adapter (decodes), also each row's adapter."""
    plan = _grouped_rows(lora, stack)
    plan.scale = stack.scale
    if sum(plan.counts) <= ROWS_PER_ADAPTER_FOR_BATCHED_ROWS * len(plan.counts):
        device = stack.a.device
        counts = torch.tensor(plan.counts, device=device)
        plan.row_groups = torch.repeat_interleave(torch.arange(len(plan.counts), device=device), counts)
    return plan


class KernelLoraStep:
    """Calls the Triton shrink and expand kernels: per token on the decode rows [0, D), per segment on
    the prefill rows [D, T), each group with its one LoRAKernelMeta built here, once per step."""

    def __init__(
        self,
        pool_rows: torch.Tensor,
        tables: dict[str, LoraTables],
        num_decodes: int,
        decode_slots: torch.Tensor | None,  # [D] int32 slot of each decode row (-1: none); None: no LoRA
        segments: LoraSegments | None,  # the prefill chunks; None: none of them has an adapter
    ):
        from ..kernels import lora_dora, lora_expand, lora_shrink

        self._shrink, self._expand, self._dora = lora_shrink, lora_expand, lora_dora
        self.pool_rows = pool_rows
        self.num_decodes = num_decodes
        self.decodes = decode_slots is not None
        self.prefills = segments is not None
        self.metas = {group: kernel_meta(t, decode_slots, segments) for group, t in tables.items()}

    def __call__(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        meta = self.metas.get(group)
        if meta is None:
            return
        pool, d = self.pool_rows, self.num_decodes
        if self.decodes:
            shrunk = self._shrink.lora_shrink_tokens(x[:d], pool, meta, layer)
            self._expand.lora_expand_tokens(y[:d], shrunk, pool, meta, layer)
            if meta.d_starts is not None:  # a DoRA adapter in the step: scale its rows (lora/dora.py)
                self._dora.lora_dora_scale_tokens(y[:d], pool, meta, layer)
        if self.prefills:
            shrunk = self._shrink.lora_shrink_segments(x[d:], pool, meta, layer)
            self._expand.lora_expand_segments(y[d:], shrunk, pool, meta, layer)
            if meta.d_starts is not None:
                self._dora.lora_dora_scale_segments(y[d:], pool, meta, layer)


def kernel_meta(
    tables: LoraTables, decode_slots: torch.Tensor | None, segments: LoraSegments | None
) -> LoRAKernelMeta:
    """One group's kernel metadata for a step: the adapter set's tables (all layers) and the batch's
    token -> slot maps, decode rows per token and prefill rows per segment (relative to row D)."""
    return LoRAKernelMeta(
        tables.a_starts,
        tables.b_starts,
        tables.b_cols,
        tables.b_widths,
        tables.slot_start,
        tables.slot_rank,
        max_rank=tables.max_rank,
        token_slot=decode_slots,
        seg_starts=None if segments is None else segments.starts,
        seg_slot=None if segments is None else segments.slots,
        max_seg_len=None if segments is None else segments.longest,
        d_starts=tables.d_starts if tables.dora else None,
    )


class KernelLoraStacker:
    """Builds KernelLoraSteps for the Triton kernels."""

    def __init__(self, residency: ResidentAdapters):
        self.residency = residency
        # The persistent tables plus the set's slot starts and ranks: no per-adapter data copied per step.
        self._tables = _PerAdapterSet(residency, residency.tables.step_tables)

    def build(self, batch: StepBatch) -> KernelLoraStep | None:
        lora = batch.lora
        if lora is None:
            return None
        tables = self._tables(lora.adapters)
        return KernelLoraStep(
            self.residency.pool_rows, tables, batch.num_decodes, lora.decode_slots, lora.segments
        )
