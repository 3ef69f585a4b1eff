"""The only part of the engine that touches the device: builds a step's tensors and runs the model.

A step's chunks are laid out as one flat token batch, decodes (one-token chunks) first, longest context
first, then prefill chunks. Linear layers see all tokens at once; attention splits them again: one
batched paged-decode call per group of decodes of similar context length (padding a short context to
the longest one in its call is wasted work), one call per prefill chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .kernels import reference
from .kv_cache import KVCache
from .lora.step import LoraStacker
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
class DecodeGroup:
    start: int  # rows [start, end) of the flat batch
    end: int
    block_tables: torch.Tensor  # [end - start, max_blocks]
    context_lens: torch.Tensor  # [end - start]


# A decode group closes when the next context needs fewer than this share of the group's widest pages.
_GROUP_SHARE = 0.7
_MIN_GROUP = 4


def group_decodes(num_blocks: list[int]) -> list[tuple[int, int]]:
    """Split decodes, sorted by block count descending, into [start, end) runs of similar width."""
    groups: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(num_blocks) + 1):
        at_end = i == len(num_blocks)
        if at_end or (
            num_blocks[i] < _GROUP_SHARE * num_blocks[start]
            and i - start >= _MIN_GROUP
            and len(num_blocks) - i >= _MIN_GROUP
        ):
            groups.append((start, i))
            start = i
    return groups


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] page * page_size + offset of each token
    decodes: list[DecodeGroup]  # together rows [0, num_decodes): one-token chunks
    prefills: list[PrefillSegment]
    logits_indices: torch.Tensor  # [S] rows whose next-token logits are sampled
    token_adapters: list[str | None]  # [T] each row's adapter (None: the base model)


class PagedAttention:
    """The attention callable the model calls per layer for one step (CPU reference ops)."""

    def __init__(self, cache: KVCache, batch: StepBatch, scale: float):
        self.cache = cache
        self.batch = batch
        self.scale = scale

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b = self.batch
        memory = self.cache.memory
        reference.write_kv(memory, layer, k, v, b.slots)
        parts = [
            reference.paged_decode_attention(
                q[g.start : g.end], memory, layer, g.block_tables, g.context_lens, self.scale
            )
            for g in b.decodes
        ]
        for seg in b.prefills:
            if seg.fresh:
                parts.append(
                    reference.causal_attention(
                        q[seg.start : seg.end], k[seg.start : seg.end], v[seg.start : seg.end], self.scale
                    )
                )
            else:
                parts.append(
                    reference.prefill_attention(
                        q[seg.start : seg.end], memory, layer, seg.block_table, seg.context_len, self.scale
                    )
                )
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache, lora: LoraStacker | None = None):
        self.model = model
        self.cache = cache
        self.lora = lora
        self.device = model.device
        self.scale = model.config.head_dim**-0.5

    def order(self, chunks: Sequence[ScheduledChunk]) -> list[ScheduledChunk]:
        """Decodes first, longest context first, then prefill chunks: the layout `build` expects."""
        decodes = sorted((c for c in chunks if c.num_tokens == 1), key=lambda c: -c.end)
        return decodes + [c for c in chunks if c.num_tokens > 1]

    def build(self, chunks: Sequence[ScheduledChunk]) -> StepBatch:
        page_size = self.cache.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSegment] = []
        token_adapters: list[str | None] = []
        for chunk in chunks:
            request = chunk.request
            row = len(ids)
            token_adapters.extend([request.adapter] * chunk.num_tokens)
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

        def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        decodes = []
        for start, end in group_decodes([len(t) for t in decode_tables]):
            width = len(decode_tables[start])  # the widest: sorted descending
            padded = [t + [0] * (width - len(t)) for t in decode_tables[start:end]]  # masked out
            decodes.append(DecodeGroup(start, end, tensor(padded), tensor(decode_lens[start:end])))
        return StepBatch(
            input_ids=tensor(ids),
            positions=tensor(positions),
            slots=tensor(slots),
            decodes=decodes,
            prefills=prefills,
            logits_indices=tensor(logits_rows),
            token_adapters=token_adapters,
        )

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Float32 logits [S, vocab] for the batch's sampled rows, in chunk order."""
        attention = PagedAttention(self.cache, batch, self.scale)
        lora = self.lora.build(batch.token_adapters) if self.lora is not None else None
        return self.model(batch.input_ids, batch.positions, attention, batch.logits_indices, lora)
