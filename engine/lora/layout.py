"""Where an adapter's matrices live in the pool, and the row indices the LoRA ops gather with.

The pool is addressed as rows of `head_dim` elements (`memory.view(-1, head_dim)`): every projection
width is a multiple of head_dim in Llama-family models, and a page holds a whole number of such rows,
so a matrix row is a run of consecutive pool rows that never straddles a page. An adapter packs, layer
by layer and module by module, A's rank rows and then B's rank columns stored as rows (B^T, already
multiplied by the module's scale), into a virtual row space; its page table maps that space onto the
pages it was given, which can be anywhere in the pool.

The ops work on four projection groups, the model's fused matmuls: qkv, o, gate_up, down. For each
group an adapter contributes C rows (the sum of its ranks in the group, the same in every layer, layers
with fewer padded by the zero row): A rows [C, in] and B rows [C, group_out] where each module's B sits
in its own column block and the rest points at the zero row (page 0, reserved and never written).

A DoRA adapter also packs, after its A and B rows, one scale row per layer and group it adapts: the
group's output width of h = g - 1, where g = m / ||W0 + scale * B A|| is each output channel's DoRA
scale (engine/lora/dora.py), and h = 0 in the columns of the group's modules it does not adapt. The
pool keeps g - 1 rather than g so that the zero row means "no scale" (plain LoRA adapters, layers the
adapter skips) and a 16-bit pool keeps g's precision near 1, where it always is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from loraplex.adapters import AdapterManifest, BaseShape

NULL_ROW = 0  # first row of the reserved page 0

# Projection groups in the order the model applies them, and the modules each fuses.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q", "k", "v"),
    "o": ("o",),
    "gate_up": ("gate", "up"),
    "down": ("down",),
}


def group_width(base: BaseShape, group: str) -> tuple[int, int]:
    """(in_features, out_features) of a group's fused matmul."""
    modules = GROUPS[group]
    return base.features(modules[0])[0], sum(base.features(m)[1] for m in modules)


@dataclass
class PackedAdapter:
    """An adapter laid out for the pool: its data in virtual-row order, and per group its row indices."""

    num_rows: int  # virtual rows used, page padding included
    data: torch.Tensor  # [rows_written, head_dim] in virtual order (only rows that hold data)
    data_rows: torch.Tensor  # [rows_written] virtual row of each data row
    a_rows: dict[str, torch.Tensor]  # group -> [layers, C, in / head_dim] virtual rows (-1: zero row)
    b_rows: dict[str, torch.Tensor]  # group -> [layers, C, out / head_dim] virtual rows (-1: zero row)
    # DoRA only: group -> [layers, out / head_dim] virtual rows of each layer's g - 1 (-1: zero row)
    d_rows: dict[str, torch.Tensor] = field(default_factory=dict)
    # DoRA weights whose scales are still to be computed on the device (lora/loader.py), else None
    dora_pending: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] | None = None

    def pages_needed(self, rows_per_page: int) -> int:
        return -(-self.num_rows // rows_per_page)


def pack_adapter(
    manifest: AdapterManifest,
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
    base: BaseShape,
    head_dim: int,
    rows_per_page: int,
    scales: dict[tuple[int, str], torch.Tensor] | None = None,
) -> PackedAdapter:
    """Lay out A and scaled B^T of every adapted module; build each group's gather indices. A DoRA
    adapter's `scales`, (layer, module) -> h = g - 1 [out] of every adapted module, are laid out after
    them as one row of the group's width per layer and group (`dora_groups`; zeros while None)."""
    for width in (base.hidden_size, base.intermediate_size, base.q_size, base.kv_size):
        if width % head_dim:
            raise ValueError(f"projection width {width} is not a multiple of head_dim {head_dim}")
    by_module = {(m.layer, m.module): m for m in manifest.modules}
    cursor = _RowCursor(head_dim, rows_per_page)
    chunks: list[torch.Tensor] = []
    chunk_rows: list[torch.Tensor] = []

    def place(matrix: torch.Tensor) -> None:
        rank, width = matrix.shape
        rows = cursor.place(rank, width)  # [rank, per_row]
        chunks.append(matrix.reshape(rank * (width // head_dim), head_dim))
        chunk_rows.append(rows.flatten())

    starts_of: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), (a, b) in sorted(weights.items()):
        lora = by_module[(layer, module)]
        b_scaled_t = (b.float() * lora.scale).t().contiguous().to(a.dtype)  # [rank, out]
        place(a)
        a_rows_block = chunk_rows[-1].view(lora.rank, -1)
        place(b_scaled_t)
        b_rows_block = chunk_rows[-1].view(lora.rank, -1)
        starts_of[(layer, module)] = (a_rows_block, b_rows_block)

    a_rows: dict[str, torch.Tensor] = {}
    b_rows: dict[str, torch.Tensor] = {}
    for group, modules in GROUPS.items():
        in_width, out_width = group_width(base, group)
        ranks = [
            sum(by_module[(layer, m)].rank for m in modules if (layer, m) in by_module)
            for layer in range(base.num_layers)
        ]
        count = max(ranks)
        if count == 0:
            continue
        a_index = torch.full((base.num_layers, count, in_width // head_dim), -1, dtype=torch.long)
        b_index = torch.full((base.num_layers, count, out_width // head_dim), -1, dtype=torch.long)
        for layer in range(base.num_layers):
            row, column = 0, 0
            for module in modules:
                out_cols = base.features(module)[1] // head_dim
                if (layer, module) in starts_of:
                    a_block, b_block = starts_of[(layer, module)]
                    rank = a_block.shape[0]
                    a_index[layer, row : row + rank] = a_block
                    b_index[layer, row : row + rank, column : column + out_cols] = b_block
                    row += rank
                column += out_cols
        a_rows[group], b_rows[group] = a_index, b_index

    d_rows: dict[str, torch.Tensor] = {}
    if manifest.dora:  # without `scales`, zeros for now (the loader fills them in: lora/loader.py)
        dtype = chunks[0].dtype
        for layer, group in dora_groups(manifest):
            out_width = group_width(base, group)[1]
            scale_row = torch.zeros(1, out_width, dtype=torch.float32)
            column = 0
            for module in GROUPS[group]:
                width = base.features(module)[1]
                if (layer, module) in by_module and scales is not None:
                    scale_row[0, column : column + width] = scales[(layer, module)]
                column += width
            place(scale_row.to(dtype))
            index = d_rows.setdefault(
                group, torch.full((base.num_layers, out_width // head_dim), -1, dtype=torch.long)
            )
            index[layer] = chunk_rows[-1]
    data = torch.cat(chunks) if chunks else torch.empty(0, head_dim)
    order = torch.cat(chunk_rows) if chunk_rows else torch.empty(0, dtype=torch.long)
    return PackedAdapter(max(cursor.position, 1), data, order, a_rows, b_rows, d_rows)


def dora_groups(manifest: AdapterManifest) -> list[tuple[int, str]]:
    """(layer, group) of every DoRA scale row a DoRA adapter packs, in packing order (none otherwise)."""
    if not manifest.dora:
        return []
    adapted = {(m.layer, m.module) for m in manifest.modules}
    layers = sorted({m.layer for m in manifest.modules})
    return [
        (layer, group)
        for layer in layers
        for group, modules in GROUPS.items()
        if any((layer, m) in adapted for m in modules)
    ]


class _RowCursor:
    """Hands out virtual rows for matrix rows, never letting one straddle a page."""

    def __init__(self, head_dim: int, rows_per_page: int):
        self.head_dim = head_dim
        self.rows_per_page = rows_per_page
        self.position = 0

    def place(self, rank: int, width: int) -> torch.Tensor:
        """Virtual rows [rank, width / head_dim] of a [rank, width] matrix placed next."""
        per_row = width // self.head_dim
        starts = []
        for _ in range(rank):
            if self.position % self.rows_per_page + per_row > self.rows_per_page:
                self.position += self.rows_per_page - self.position % self.rows_per_page
            starts.append(self.position)
            self.position += per_row
        return torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(per_row)[None, :]


def count_rows(manifest: AdapterManifest, head_dim: int, rows_per_page: int, base: BaseShape) -> int:
    """The virtual rows `pack_adapter` will use for this manifest, known before reading any weights."""
    cursor = _RowCursor(head_dim, rows_per_page)
    for lora in sorted(manifest.modules, key=lambda m: (m.layer, m.module)):
        cursor.place(lora.rank, lora.in_features)
        cursor.place(lora.rank, lora.out_features)
    for _, group in dora_groups(manifest):
        cursor.place(1, group_width(base, group)[1])
    return max(cursor.position, 1)


def physical_rows(virtual: torch.Tensor, pages: list[int], rows_per_page: int) -> torch.Tensor:
    """Map virtual rows to pool rows through the adapter's page table; -1 maps to the zero row."""
    table = torch.tensor(pages, dtype=torch.long)
    clamped = virtual.clamp(min=0)
    physical = table[clamped // rows_per_page] * rows_per_page + clamped % rows_per_page
    return torch.where(virtual < 0, torch.full_like(physical, NULL_ROW), physical)
