"""The only part of the engine that touches the device: builds a step's tensors and runs the model.

A step's chunks are laid out as one flat token batch, decodes (one-token chunks) first, then prefill
chunks. Linear layers see all tokens at once; attention splits them again: one batched paged-decode
call for the decodes, one call per prefill chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .kernels import reference
from .kv_cache import KVCache
from .model.llama import LlamaModel
from .scheduler import ScheduledChunk


@dataclass
class PrefillSegment:
    start: int  # first row in the flat batch
    end: int
    context_len: int  # cached prefix + this chunk
    block_table: torch.Tensor  # [num_blocks]

    @property
    def fresh(self) -> bool:
        """No cached prefix: attention can use the chunk's own keys and values directly."""
        return self.end - self.start == self.context_len


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] page * page_size + offset of each token
    num_decodes: int  # rows [0, num_decodes) are one-token chunks
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor  # [num_decodes]
    prefills: list[PrefillSegment]
    logits_indices: torch.Tensor  # [S] rows whose next-token logits are sampled


class PagedAttention:
    """The attention callable the model calls per layer for one step (CPU reference ops)."""

    def __init__(self, cache: KVCache, batch: StepBatch, scale: float):
        self.cache = cache
        self.batch = batch
        self.scale = scale

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b = self.batch
        k_cache, v_cache = self.cache.layer(layer)
        reference.write_kv(k_cache, v_cache, k, v, b.slots)
        n = b.num_decodes
        parts: list[torch.Tensor] = []
        if n:
            parts.append(
                reference.paged_decode_attention(
                    q[:n], k_cache, v_cache, b.decode_block_tables, b.decode_context_lens, self.scale
                )
            )
        for seg in b.prefills:
            if seg.fresh:
                parts.append(
                    reference.causal_attention(q[seg.start : seg.end], k[seg.start : seg.end],
                                               v[seg.start : seg.end], self.scale)
                )
            else:
                parts.append(
                    reference.prefill_attention(
                        q[seg.start : seg.end], k_cache, v_cache, seg.block_table, seg.context_len, self.scale
                    )
                )
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache):
        self.model = model
        self.cache = cache
        self.device = model.device
        self.scale = model.config.head_dim**-0.5

    def order(self, chunks: Sequence[ScheduledChunk]) -> list[ScheduledChunk]:
        """Decodes first, then prefill chunks: the layout `build` expects."""
        return [c for c in chunks if c.num_tokens == 1] + [c for c in chunks if c.num_tokens > 1]

    def build(self, chunks: Sequence[ScheduledChunk]) -> StepBatch:
        page_size = self.cache.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSegment] = []
        for chunk in chunks:
            request = chunk.request
            row = len(ids)
            ids.extend(request.tokens(chunk.start, chunk.end))
            span = range(chunk.start, chunk.end)
            positions.extend(span)
            pages = request.pages
            slots.extend(pages[p // page_size] * page_size + p % page_size for p in span)
            num_blocks = -(-chunk.end // page_size)
            if chunk.num_tokens == 1:
                decode_tables.append(pages[:num_blocks])
                decode_lens.append(chunk.end)
            else:
                table = torch.tensor(pages[:num_blocks], dtype=torch.long, device=self.device)
                prefills.append(PrefillSegment(row, len(ids), chunk.end, table))
            if chunk.samples:
                logits_rows.append(len(ids) - 1)
        width = max((len(t) for t in decode_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in decode_tables]  # page 0 rows are masked out

        def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        return StepBatch(
            input_ids=tensor(ids),
            positions=tensor(positions),
            slots=tensor(slots),
            num_decodes=len(decode_tables),
            decode_block_tables=tensor(padded).view(len(padded), width),
            decode_context_lens=tensor(decode_lens),
            prefills=prefills,
            logits_indices=tensor(logits_rows),
        )

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Float32 logits [S, vocab] for the batch's sampled rows, in chunk order."""
        attention = PagedAttention(self.cache, batch, self.scale)
        return self.model(batch.input_ids, batch.positions, attention, batch.logits_indices)
