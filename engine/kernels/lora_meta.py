"""What the multi-adapter LoRA kernels read besides the activations and the pool, in one value.

The shrink and expand kernels (lora_shrink.py, lora_expand.py) and their plain-torch oracles
(reference.py) take `(x or y, pool_rows, meta, layer)`; `meta` carries the step's adapter tables for one
projection group and which rows use which adapter. The LoRA step (engine/lora/step.py) builds one per
group once per step, from the persistent tables (engine/lora/tables.py) and the batch's metadata
(engine/batch.py), so a layer's call only picks its row of the tables. Nothing here is copied: the
fields are the tensors the engine already holds on the device.

Rows of the group: slot u owns stacked rows slot_start[u] .. slot_start[u] + slot_rank[u] - 1 (rank
0: the adapter does not adapt this group). Stacked row c of layer l has an A row of width `in` that
starts at pool row a_starts[l, c], and a scaled B^T row of width b_widths[l, c] that starts at pool row
b_starts[l, c] and lands in output columns b_cols[l, c] onward (width 0: a padding row).

Which rows use which slot, in one of two forms (a step has either, both or neither):
- per token (decodes, BGMV-style): row t of x uses slot token_slot[t] (-1: none);
- per segment (prefill chunks, SGMV-style): rows seg_starts[g] .. seg_starts[g + 1] - 1 of x use slot
  seg_slot[g] (-1: none), empty segments allowed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRAKernelMeta:
    a_starts: torch.Tensor  # [L, C] int64
    b_starts: torch.Tensor  # [L, C] int64
    b_cols: torch.Tensor  # [L, C] int32, multiples of col_align
    b_widths: torch.Tensor  # [L, C] int32, multiples of col_align (0: a padding row)
    slot_start: torch.Tensor  # [S] int32
    slot_rank: torch.Tensor  # [S] int32
    # max(slot_rank) and the longest segment, known on the host so launches need no device sync
    # (None: the wrappers read them from the tensors, a sync; tests only).
    max_rank: int | None = None
    token_slot: torch.Tensor | None = None  # [T] int32 (None: no per-token rows)
    seg_starts: torch.Tensor | None = None  # [G + 1] int32
    seg_slot: torch.Tensor | None = None  # [G] int32 (None with seg_starts: no segments)
    max_seg_len: int | None = None
    # DoRA (lora_dora.py): [L, C] int64, at slot u's first column slot_start[u] the pool row of its
    # g - 1 row for each layer (0: none). None: no adapter of the step is a DoRA one.
    d_starts: torch.Tensor | None = None
    # What every b_col and b_width is a multiple of, if not gcd(head_dim, 16) as the engine's tables
    # make them (a wrong value gives wrong results on a GPU).
    col_align: int | None = None

    def __post_init__(self) -> None:
        if self.a_starts.dim() != 2 or self.b_starts.shape != self.a_starts.shape:
            raise ValueError(
                f"a_starts {tuple(self.a_starts.shape)} and b_starts {tuple(self.b_starts.shape)} must "
                "both be [layers, rows]: add a leading layer dimension to one layer's tables"
            )
        if (self.seg_starts is None) != (self.seg_slot is None):
            raise ValueError("seg_starts and seg_slot come together: give both or neither")

    def rank(self) -> int:
        """max(slot_rank): the shrunk activations' width."""
        if self.max_rank is not None:
            return self.max_rank
        return int(self.slot_rank.max()) if len(self.slot_rank) else 0

    def tokens(self) -> torch.Tensor:
        """token_slot, which the per-token kernels need."""
        if self.token_slot is None:
            raise ValueError("the per-token LoRA kernels need meta.token_slot")
        return self.token_slot

    def segments(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(seg_starts, seg_slot, the longest segment), which the per-segment kernels need."""
        if self.seg_starts is None or self.seg_slot is None:
            raise ValueError("the per-segment LoRA kernels need meta.seg_starts and meta.seg_slot")
        longest = self.max_seg_len
        if longest is None:
            lengths = self.seg_starts[1:] - self.seg_starts[:-1]
            longest = int(lengths.max()) if len(self.seg_slot) else 0
        return self.seg_starts, self.seg_slot, longest
