"""The only part of the engine that touches the device: builds a step's tensors and runs the model.

A step's chunks are laid out as one flat token batch, decodes (one-token chunks) first, longest context
first, then prefill chunks. Linear layers see all tokens at once; attention splits them again: one
batched paged-decode call per group of decodes of similar context length (padding a short context to
the longest one in its call is wasted work), one call per prefill chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .attention import ReferenceAttention, TritonAttention
from .kv_cache import KVCache
from .lora.step import KernelLoraStacker, LoraStacker
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
class PrefillBatch:
    """All prefill chunks of a step for one varlen kernel launch: rows [start, T) of the flat batch."""

    start: int
    block_tables: torch.Tensor  # [S, max_blocks], padded with the zero page
    q_starts: torch.Tensor  # [S + 1] chunk boundaries, relative to `start`
    context_lens: torch.Tensor  # [S]
    max_chunk_len: int


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] page * page_size + offset of each token
    decodes: list[DecodeGroup]  # together rows [0, num_decodes): one-token chunks
    prefills: list[PrefillSegment]
    logits_indices: torch.Tensor  # [S] rows whose next-token logits are sampled
    token_adapters: list[str | None]  # [T] each row's adapter (None: the base model)
    prefill_varlen: PrefillBatch | None = None  # the prefills again, laid out for the kernels

    @property
    def num_decodes(self) -> int:
        return self.decodes[-1].end if self.decodes else 0


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        lora: LoraStacker | KernelLoraStacker | None = None,
        use_kernels: bool = False,
    ):
        """`use_kernels`: attention and LoRA through the Triton kernels (CUDA, or the CPU interpreter)
        instead of the plain-torch reference ops."""
        self.model = model
        self.cache = cache
        self.lora = lora
        self.use_kernels = use_kernels
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
        prefill_pages: list[list[int]] = []
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
                prefill_pages.append(pages[:num_blocks])
                table = torch.tensor(pages[:num_blocks], dtype=torch.long, device=self.device)
                prefills.append(PrefillSegment(row, len(ids), chunk.end, table))
            if chunk.samples:
                logits_rows.append(len(ids) - 1)

        def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        decodes = []
        widths = [len(t) for t in decode_tables]
        # The kernels walk each sequence's own pages: no padding waste, so one launch for all decodes.
        spans = ([(0, len(widths))] if widths else []) if self.use_kernels else group_decodes(widths)
        for start, end in spans:
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
            prefill_varlen=(
                self._prefill_batch(prefills, prefill_pages, tensor)
                if self.use_kernels and prefills
                else None
            ),
        )

    @staticmethod
    def _prefill_batch(
        prefills: list[PrefillSegment], pages: list[list[int]], tensor: Callable[[list[Any]], torch.Tensor]
    ) -> PrefillBatch:
        width = max(len(p) for p in pages)
        tables = [p + [0] * (width - len(p)) for p in pages]  # padding: the zero page, never read
        first = prefills[0].start
        return PrefillBatch(
            start=first,
            block_tables=tensor(tables),
            q_starts=tensor([seg.start - first for seg in prefills] + [prefills[-1].end - first]),
            context_lens=tensor([seg.context_len for seg in prefills]),
            max_chunk_len=max(seg.end - seg.start for seg in prefills),
        )

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Float32 logits [S, vocab] for the batch's sampled rows, in chunk order."""
        attention_type = TritonAttention if self.use_kernels else ReferenceAttention
        attention = attention_type(self.cache.memory, batch, self.scale)
        lora = self.lora.build(batch) if self.lora is not None else None
        return self.model(batch.input_ids, batch.positions, attention, batch.logits_indices, lora)
