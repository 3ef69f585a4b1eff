"""The index tables the lora_shrink / lora_expand kernels read, built from resident adapters' pool rows.

Layout (see `layout.py`) gives each adapter, per projection group, the pool rows of its
stacked A rows `a_rows[group]` [layers, C_u, in / head_dim] and B^T rows `b_rows[group]` [layers, C_u,
out / head_dim]: a matrix row is a run of consecutive pool rows, and a B row's entries outside its
module's column block are the null row. The kernels want only where each row begins and, for B, which
columns it writes, so the tables keep one number per stacked row instead of one per head_dim of width.

Those numbers (`RowMeta`) are derived once per adapter, when it is loaded, and written into persistent
per-group tables where the adapter owns a range of columns while it stays resident (`ResidentTables`).
A step then needs only its adapters' range starts and ranks (`slot_start`, `slot_rank`).

DoRA adapters (lora/dora.py) add one number per layer: the pool row where that layer's g - 1 row of the
group begins, kept in `d_starts` at the first column of the adapter's range (0, the zero row: no scale,
as for every plain LoRA adapter and every layer a DoRA adapter skips).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from loraplex.adapters import BaseShape

from .layout import GROUPS, NULL_ROW, group_width


class AdapterRows(Protocol):
    """An adapter's pool rows per group (a resident adapter of engine/lora/ is one)."""

    @property
    def a_rows(self) -> Mapping[str, torch.Tensor]: ...  # group -> [layers, C_u, in / head_dim] pool rows

    @property
    def b_rows(self) -> Mapping[str, torch.Tensor]: ...  # group -> [layers, C_u, out / head_dim]


@dataclass
class LoraTables:
    """One projection group's tables for a step's adapters in slot order; index [layer] per call.

    Column c of layer l: its A row starts at pool row a_starts[l, c]; its B^T row starts at pool
    row b_starts[l, c] and fills output columns b_cols[l, c] .. b_cols[l, c] + b_widths[l, c] - 1
    (width 0: a padding row, where the adapter has fewer ranks in this layer than in its widest).
    Slot u owns columns slot_start[u] .. slot_start[u] + slot_rank[u] - 1 in every layer (rank 0: the
    adapter does not adapt this group); columns no slot owns are never read.
    """

    a_starts: torch.Tensor  # [L, C] int64 (C: every resident adapter's columns, ResidentTables)
    b_starts: torch.Tensor  # [L, C] int64
    b_cols: torch.Tensor  # [L, C] int32
    b_widths: torch.Tensor  # [L, C] int32
    slot_start: torch.Tensor  # [S] int32
    slot_rank: torch.Tensor  # [S] int32
    max_rank: int  # max(slot_rank), known on the host so launches need no device sync
    # [L, C] int64: at a DoRA adapter's first column, the pool row of its g - 1 row per layer (0: none)
    d_starts: torch.Tensor | None = None
    dora: bool = False  # whether a slot's adapter is a DoRA one (host-known: the scale runs only then)


@dataclass(frozen=True)
class RowMeta:
    """One adapter's compact metadata for one group, built once when it is loaded: per layer and
    stacked row, where its A row and B^T row begin, and which output columns the B row fills."""

    a_starts: torch.Tensor  # [L, C] int64 (C: every resident adapter's columns, ResidentTables)
    b_starts: torch.Tensor  # [L, C] int64
    b_cols: torch.Tensor  # [L, C] int32
    b_widths: torch.Tensor  # [L, C] int32 (0: a padding row)
    d_starts: torch.Tensor | None = None  # [L] int64 DoRA: each layer's g - 1 row start (0: none)

    @property
    def rank(self) -> int:
        return self.a_starts.shape[1]


def row_meta(
    a_rows: torch.Tensor,
    b_rows: torch.Tensor,
    group: str,
    base: BaseShape,
    head_dim: int,
    d_rows: torch.Tensor | None = None,
) -> RowMeta:
    """The RowMeta of one adapter's pool rows in `group`: a_rows [L, C, in / head_dim], b_rows
    [L, C, out / head_dim], physical pool rows (NULL_ROW for the zero row); a DoRA adapter's d_rows
    [L, out / head_dim] (its g - 1 rows, consecutive pool rows where a layer has one)."""
    if b_rows.shape[2] * head_dim != group_width(base, group)[1]:
        raise ValueError(f"{group} B rows span {b_rows.shape[2]} head_dim rows; base shape disagrees")
    b_starts = torch.zeros(b_rows.shape[:2], dtype=torch.long, device=b_rows.device)
    b_cols = torch.zeros(b_rows.shape[:2], dtype=torch.int32, device=b_rows.device)
    b_widths = torch.zeros(b_rows.shape[:2], dtype=torch.int32, device=b_rows.device)
    column = 0
    for module in GROUPS[group]:
        width = base.features(module)[1]
        # A stacked row belongs to the module whose column block it fills; a module's B row is never
        # the null row, so its block's first entry tells, and is where the row begins.
        first = b_rows[:, :, column // head_dim]
        owns = first != NULL_ROW
        b_starts = torch.where(owns, first, b_starts)
        b_cols.masked_fill_(owns, column)
        b_widths.masked_fill_(owns, width)
        column += width
    d_starts = None if d_rows is None else d_rows[:, 0].long().contiguous()
    return RowMeta(a_rows[:, :, 0].long().contiguous(), b_starts, b_cols, b_widths, d_starts)


def adapter_meta(adapter: AdapterRows, base: BaseShape, head_dim: int) -> dict[str, RowMeta]:
    """RowMeta for every group the adapter adapts."""
    d_rows: Mapping[str, torch.Tensor] = getattr(adapter, "d_rows", {})  # DoRA adapters only
    return {
        g: row_meta(adapter.a_rows[g], adapter.b_rows[g], g, base, head_dim, d_rows.get(g))
        for g in adapter.a_rows
    }


class _GroupTable:
    """One group's persistent tables [L, capacity]: each resident adapter owns a range of columns
    (allocated first-fit when it is loaded, freed when it leaves), so a step only says where its
    adapters' ranges begin. Unowned columns are zero (width 0: they write nothing) once `clear_freed`
    ran: freeing is bookkeeping only, as an adapter leaves the pool inside the scheduler's reclaim,
    which touches no device; the loader zeroes freed columns before it writes any (`add`)."""

    def __init__(self, num_layers: int, device: torch.device, capacity: int):
        self.a_starts = torch.zeros(num_layers, capacity, dtype=torch.long, device=device)
        self.b_starts = torch.zeros_like(self.a_starts)
        self.b_cols = torch.zeros(num_layers, capacity, dtype=torch.int32, device=device)
        self.b_widths = torch.zeros_like(self.b_cols)
        self.d_starts = torch.zeros_like(self.a_starts)
        self.dora: set[str] = set()  # the resident DoRA adapters
        self.free: list[tuple[int, int]] = [(0, capacity)]  # (start, size), ascending, coalesced
        self.freed: list[tuple[int, int]] = []  # free ranges whose columns still hold a former adapter's
        self.ranges: dict[str, tuple[int, int]] = {}

    @property
    def capacity(self) -> int:
        return self.a_starts.shape[1]

    def add(self, name: str, meta: RowMeta) -> None:
        self.clear_freed()  # a freed range is zero before it is handed out again
        start = self._allocate(meta.rank)
        end = start + meta.rank
        self.a_starts[:, start:end] = meta.a_starts
        self.b_starts[:, start:end] = meta.b_starts
        self.b_cols[:, start:end] = meta.b_cols
        self.b_widths[:, start:end] = meta.b_widths
        if meta.d_starts is not None:
            self.d_starts[:, start] = meta.d_starts
            self.dora.add(name)
        self.ranges[name] = (start, meta.rank)

    def remove(self, name: str) -> None:
        """Free the adapter's columns: bookkeeping, no device write (no step reads them any more)."""
        start, size = self.ranges.pop(name)
        self.dora.discard(name)
        self.free = _coalesce([*self.free, (start, size)])
        self.freed.append((start, size))

    def clear_freed(self) -> None:
        """Zero the columns freed since the last call (device writes)."""
        for start, size in self.freed:
            for table in (self.a_starts, self.b_starts, self.b_cols, self.b_widths, self.d_starts):
                table[:, start : start + size] = 0
        self.freed.clear()

    def _allocate(self, size: int) -> int:
        for i, (start, free) in enumerate(self.free):
            if free >= size:
                self.free[i : i + 1] = [(start + size, free - size)] if free > size else []
                return start
        self._grow(max(2 * self.capacity, self.capacity + size))
        return self._allocate(size)

    def _grow(self, capacity: int) -> None:
        """Reallocate at `capacity` columns (an adapter load, never a step: the residency's version
        changes with the load, so no step keeps the old tensors)."""
        old = self.capacity
        for attr in ("a_starts", "b_starts", "b_cols", "b_widths", "d_starts"):
            table = getattr(self, attr)
            grown = table.new_zeros(table.shape[0], capacity)
            grown[:, :old] = table
            setattr(self, attr, grown)
        self.free = _coalesce([*self.free, (old, capacity - old)])


def _coalesce(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, size in sorted(r for r in ranges if r[1] > 0):
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1] = (merged[-1][0], merged[-1][1] + size)
        else:
            merged.append((start, size))
    return merged


class ResidentTables:
    """The kernels' tables for every resident adapter, per projection group, kept on the device.

    An adapter's RowMeta is written into its groups' tables once, when it is loaded, and its columns
    are freed when it leaves the pool (zeroed when the loader next loads); a step's tables are these
    same tensors plus slot_start and slot_rank for its adapters (one small host-to-device copy for all
    groups): nothing per adapter is concatenated or copied per step."""

    def __init__(self, num_layers: int, device: torch.device, capacity: int = 256):
        self.num_layers = num_layers
        self.device = device
        self.capacity = capacity
        self.groups: dict[str, _GroupTable] = {}

    def add(self, name: str, meta: Mapping[str, RowMeta]) -> None:
        """Write a just-loaded adapter's metadata (replacing what a former load of `name` left)."""
        self.remove(name)
        for group, rows in meta.items():
            if rows.a_starts.shape[0] != self.num_layers:
                raise ValueError(
                    f"{name}: {group} metadata has {rows.a_starts.shape[0]} layers, not {self.num_layers}"
                )
            table = self.groups.get(group)
            if table is None:
                table = self.groups[group] = _GroupTable(self.num_layers, self.device, self.capacity)
            table.add(name, rows)

    def remove(self, name: str) -> None:
        """Free the adapter's columns in every group: bookkeeping only (see `clear_freed`)."""
        for table in self.groups.values():
            if name in table.ranges:
                table.remove(name)

    def clear_freed(self) -> None:
        """Zero every group's freed columns: the loader's device writes, before it loads."""
        for table in self.groups.values():
            table.clear_freed()

    def step_tables(self, names: Sequence[str]) -> dict[str, LoraTables]:
        """The tables for a step whose slot u is adapter names[u] (each resident), for every group at
        least one of them adapts."""
        used: list[tuple[str, _GroupTable, list[int], list[int]]] = []
        for group, table in self.groups.items():
            ranges = [table.ranges.get(n, (0, 0)) for n in names]
            if any(size for _, size in ranges):
                used.append((group, table, [s for s, _ in ranges], [size for _, size in ranges]))
        if not used:
            return {}
        # [G, 2, U] int32: every group's slot_start and slot_rank, one copy to the device.
        slots = torch.tensor([[starts, ranks] for _, _, starts, ranks in used], dtype=torch.int32)
        slots = slots.to(self.device, non_blocking=True)
        return {
            group: LoraTables(
                table.a_starts,
                table.b_starts,
                table.b_cols,
                table.b_widths,
                slot_start=slots[i, 0],
                slot_rank=slots[i, 1],
                max_rank=max(ranks),
                d_starts=table.d_starts,
                dora=any(n in table.dora for n in names),
            )
            for i, (group, table, _, ranks) in enumerate(used)
        }
