"""One step's LoRA work, as the model calls it per layer and projection group; tokens without an
adapter, and groups no adapter in the batch targets, cost nothing.

Two ways to do it. On the CPU (LoraStacker): gather the stacked A and B rows of the step's adapters
once, and mask each token's columns to its own adapter, so each group is two dense matmuls. With the
Triton kernels (KernelLoraStacker): the kernels read every adapter's rows straight from the pool through
small tables, per token for decodes and per segment (one prefill chunk, one adapter) for prefills."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..kernels import reference
from ..kernels.lora_tables import LoraTables, step_tables
from .layout import GROUPS
from .residency import AdapterResidency

if TYPE_CHECKING:
    from ..runner import StepBatch


class LoraStep:
    def __init__(
        self,
        stacks: dict[str, tuple[torch.Tensor, torch.Tensor]],  # group -> (a [L, C, in], b [L, C, out])
        columns: dict[str, torch.Tensor],  # group -> [T, C] 0/1: the token's adapter owns the column
    ):
        self.stacks = stacks
        self.columns = columns

    def __call__(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        stack = self.stacks.get(group)
        if stack is not None:
            reference.lora_shrink_expand(x, y, stack[0][layer], stack[1][layer], self.columns[group])


class LoraStacker:
    """Builds LoraSteps; the stacked rows are gathered once per set of adapters and reused while the
    same adapters run in the same pages (decode steps mostly do)."""

    def __init__(self, residency: AdapterResidency):
        self.residency = residency
        self._cached_key: tuple[tuple[str, ...], int] | None = None
        self._cached: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]] = ({}, {})

    def build(self, batch: StepBatch) -> LoraStep | None:
        return self.build_for(batch.token_adapters)

    def build_for(self, token_adapters: Sequence[str | None]) -> LoraStep | None:
        names = tuple(dict.fromkeys(a for a in token_adapters if a is not None))
        if not names:
            return None
        stacks, owners = self._stacks(names)
        slot = {name: i for i, name in enumerate(names)}
        device = self.residency.pool_rows.device
        token_slot = torch.tensor([slot[a] if a is not None else -1 for a in token_adapters], device=device)
        dtype = self.residency.pool_rows.dtype
        columns = {g: (owner[None, :] == token_slot[:, None]).to(dtype) for g, owner in owners.items()}
        return LoraStep(stacks, columns)

    def _stacks(
        self, names: tuple[str, ...]
    ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
        key = (names, self.residency.version)
        if key == self._cached_key:
            return self._cached
        pool_rows = self.residency.pool_rows
        stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        owners: dict[str, torch.Tensor] = {}
        for group in GROUPS:
            parts = [
                (i, self.residency.resident[name].a_rows[group], self.residency.resident[name].b_rows[group])
                for i, name in enumerate(names)
                if group in self.residency.resident[name].a_rows
            ]
            if not parts:
                continue
            a_index = torch.cat([a for _, a, _ in parts], dim=1)  # [L, C, in / head_dim]
            b_index = torch.cat([b for _, _, b in parts], dim=1)
            stacks[group] = (
                reference.gather_rows(pool_rows, a_index),
                reference.gather_rows(pool_rows, b_index),
            )
            owners[group] = torch.cat(
                [torch.full((a.shape[1],), i, device=pool_rows.device) for i, a, _ in parts]
            )
        self._cached_key, self._cached = key, (stacks, owners)
        return stacks, owners


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
