"""The index tables the lora_shrink / lora_expand kernels read, built from resident adapters' pool rows.

Layout (see `layout.py`) gives each adapter, per projection group, the pool rows of its
stacked A rows `a_rows[group]` [layers, C_u, in / head_dim] and B^T rows `b_rows[group]` [layers, C_u,
out / head_dim]: a matrix row is a run of consecutive pool rows, and a B row's entries outside its
module's column block are the null row. The kernels want only where each row begins and, for B, which
columns it writes, so the tables keep one number per stacked row instead of one per head_dim of width.
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
    """One projection group's tables for a list of adapters in slot order; index [layer] per call.

    Stacked row c of layer l: its A row starts at pool row a_starts[l, c]; its B^T row starts at pool
    row b_starts[l, c] and fills output columns b_cols[l, c] .. b_cols[l, c] + b_widths[l, c] - 1
    (width 0: a padding row, where the adapter has fewer ranks in this layer than in its widest).
    Slot u owns rows slot_start[u] .. slot_start[u] + slot_rank[u] - 1 in every layer (rank 0: the
    adapter does not adapt this group).
    """

    a_starts: torch.Tensor  # [L, C] int64
    b_starts: torch.Tensor  # [L, C] int64
    b_cols: torch.Tensor  # [L, C] int32
    b_widths: torch.Tensor  # [L, C] int32
    slot_start: torch.Tensor  # [S] int32
    slot_rank: torch.Tensor  # [S] int32
    max_rank: int  # max(slot_rank), known on the host so launches need no device sync


def group_tables(
    adapters: Sequence[AdapterRows], group: str, base: BaseShape, head_dim: int
) -> LoraTables | None:
    """The tables of `group` for `adapters` (slot u = adapters[u]); None if none of them adapts it.

    The row tensors must hold pool rows (physical rows, NULL_ROW for the zero row), not virtual ones.
    """
    ranks = [a.a_rows[group].shape[1] if group in a.a_rows else 0 for a in adapters]
    present = [a for a in adapters if group in a.a_rows]
    if not present:
        return None
    a_index = torch.cat([a.a_rows[group] for a in present], dim=1)  # [L, C, in / head_dim]
    b_index = torch.cat([a.b_rows[group] for a in present], dim=1)  # [L, C, out / head_dim]
    if b_index.shape[2] * head_dim != group_width(base, group)[1]:
        raise ValueError(f"{group} B rows span {b_index.shape[2]} head_dim rows; base shape disagrees")

    b_starts = torch.zeros(b_index.shape[:2], dtype=torch.long, device=b_index.device)
    b_cols = torch.zeros(b_index.shape[:2], dtype=torch.int32, device=b_index.device)
    b_widths = torch.zeros(b_index.shape[:2], dtype=torch.int32, device=b_index.device)
    column = 0
    for module in GROUPS[group]:
        width = base.features(module)[1]
        # A stacked row belongs to the module whose column block it fills; a module's B row is never
        # the null row, so its block's first entry tells, and is where the row begins.
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


def step_tables(adapters: Sequence[AdapterRows], base: BaseShape, head_dim: int) -> dict[str, LoraTables]:
    """group_tables for every group at least one of `adapters` adapts."""
    tables = {group: group_tables(adapters, group, base, head_dim) for group in GROUPS}
    return {group: table for group, table in tables.items() if table is not None}
