"""A step's batch: its chunks laid out as one flat token batch, with the tables attention and LoRA read.

Rows [0, D) are the decodes (one-token chunks), longest context first; rows [D, T) the prefill chunks.
Linear layers see all T rows at once; attention and LoRA split them again through the tables here.
There is one layout for both backends: the Triton kernels take the decode and prefill tables whole
(each program walks its own sequence's pages), and the torch reference ops take slices of the same
tables (`DecodeBatch.groups`, `PrefillBatch.segments`), cut on the device with no further transfer.

Every integer a step needs is written once, with numpy, into one preallocated host buffer (pinned when
the device is CUDA, so the copy is asynchronous), copied to the device in one transfer, and handed out
as views of that copy. The dozen small `torch.tensor(..., device=...)` calls this replaces were each a
synchronous transfer from pageable memory. The buffer holds int32 units; int64 sections come first, so
each starts at an even offset and is viewed as int64.

Decode-only steps can be laid out graph-ready (`DecodeBuckets`): padded to the next batch-size bucket,
block tables as wide as the longest sequence the engine allows, and one copy of a fixed size per
bucket, so every step of a bucket has the same shapes and grids whatever its requests are (what a CUDA
graph replays). Padding rows are decodes of token 0 at position 0 whose one-token context is a
reserved padding page the engine sets aside (never page 0, which must stay zero): they write there,
read there, and their logits are dropped. (The torch path's LoRA grouping, `LoraBatch.order` and the
slot counts, stays sized per step: the kernels do not read it, and the torch path is not captured.)

This module knows nothing of the scheduler, the runner or adapter residency: chunks are anything with
the `StepChunk` shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np
import torch


class StepRequest(Protocol):
    """What a batch reads of a request (engine/request.py's Request is one)."""

    @property
    def pages(self) -> Sequence[int]: ...  # KV pages, in token order

    @property
    def adapter(self) -> str | None: ...  # None: the base model

    def tokens(self, start: int, end: int) -> list[int]: ...


class StepChunk(Protocol):
    """One request's tokens [start, end) computed this step (engine/scheduler.py's ScheduledChunk)."""

    @property
    def request(self) -> StepRequest: ...

    @property
    def start(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def end(self) -> int: ...

    @property
    def samples(self) -> bool: ...  # the step samples this request's next token


Chunk = TypeVar("Chunk", bound=StepChunk)


def order_chunks(chunks: Sequence[Chunk]) -> list[Chunk]:
    """Decodes first, longest context first, then prefill chunks: the layout `BatchBuilder.build` wants."""
    decodes = sorted((c for c in chunks if c.num_tokens == 1), key=lambda c: -c.end)
    return decodes + [c for c in chunks if c.num_tokens > 1]


# Batch sizes a graph-ready decode step is padded to (vLLM's capture sizes are of the same kind).
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class DecodeBuckets:
    """How decode-only steps are padded: to the smallest of `sizes` that holds them, block tables
    `max_blocks` wide, padding rows on `padding_page`. A step larger than every bucket is not padded."""

    sizes: tuple[int, ...]
    max_blocks: int  # pages of the longest sequence the engine allows
    padding_page: int  # a reserved page padding rows write and read (not page 0: it must stay zero)

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"bucket sizes must be positive and ascending, got {self.sizes}")
        if self.max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1, got {self.max_blocks}")
        if self.padding_page < 1:
            raise ValueError("the padding page cannot be page 0, which stays zero")

    @classmethod
    def up_to(cls, largest: int, max_blocks: int, padding_page: int) -> DecodeBuckets:
        """DEFAULT_BUCKETS below `largest`, then `largest` itself (a step never has more decodes)."""
        sizes = (*(b for b in DEFAULT_BUCKETS if b < largest), largest)
        return cls(sizes, max_blocks, padding_page)

    def bucket(self, num_decodes: int) -> int | None:
        return next((b for b in self.sizes if b >= num_decodes), None)

    def upload_size(self, bucket: int) -> int:
        """Int32 units of the step buffer of a bucket at its largest (every row with its own adapter):
        each step of the bucket copies exactly this many, so the copy has one shape too."""
        int64 = 4 * bucket + bucket * self.max_blocks + bucket + bucket  # ids, pos, slots, logits; tables,
        return 2 * int64 + 3 * bucket  # lens, lora_order; decode_slots, slot_counts, slot_ends


@dataclass(frozen=True)
class _PaddingRequest:
    pages: tuple[int, ...]
    adapter: None = None

    def tokens(self, start: int, end: int) -> list[int]:
        return [0] * (end - start)


@dataclass(frozen=True)
class _PaddingChunk:
    """A decode of token 0 at position 0 whose KV slot and context are the padding page's first slot."""

    request: _PaddingRequest
    start: int = 0
    num_tokens: int = 1
    end: int = 1
    samples: bool = True


# A decode group closes when the next context needs fewer than this share of the group's widest pages.
_GROUP_SHARE = 0.7
_MIN_GROUP = 4


def group_decodes(num_blocks: Sequence[int]) -> list[tuple[int, int]]:
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
class DecodeGroup:
    """Decodes of similar context length for one reference attention call: rows [start, end)."""

    start: int
    end: int
    block_tables: torch.Tensor  # [end - start, widest] int64, padded with the zero page
    context_lens: torch.Tensor  # [end - start] int64


@dataclass
class DecodeBatch:
    """Every decode of the step: rows [0, D), one token each."""

    block_tables: torch.Tensor  # [D, max_blocks] int64, padded with the zero page (never read)
    context_lens: torch.Tensor  # [D] int64, each decode's token included
    num_blocks: list[int]  # [D] on the host: pages each decode's context spans

    @property
    def size(self) -> int:
        return len(self.num_blocks)

    def groups(self) -> list[DecodeGroup]:
        """The decodes in groups of similar context length, for the torch reference ops: a padded
        gather on a CPU is wasted work, so a short context should not be padded to the longest of the
        step. The kernels walk each sequence's own pages and take all decodes in one launch instead.
        Cut from the one table, each to its own widest context; made contiguous here, once per step,
        because the reference ops flatten the table in every layer."""
        groups = []
        for start, end in group_decodes(self.num_blocks):
            width = max(self.num_blocks[start:end])
            tables = self.block_tables[start:end, :width].contiguous()
            groups.append(DecodeGroup(start, end, tables, self.context_lens[start:end]))
        return groups


@dataclass
class PrefillSegment:
    """One prefill chunk, for the torch reference ops: rows [start, end) of the flat batch."""

    start: int
    end: int
    context_len: int  # cached prefix + this chunk
    block_table: torch.Tensor  # [num_blocks] int64 (a view of its row of PrefillBatch.block_tables)

    @property
    def fresh(self) -> bool:
        """No cached prefix: attention can use the chunk's own keys and values directly."""
        return self.end - self.start == self.context_len


@dataclass
class PrefillBatch:
    """All prefill chunks of a step for one varlen kernel launch: rows [start, T) of the flat batch."""

    start: int
    block_tables: torch.Tensor  # [P, max_blocks] int64, padded with the zero page
    q_starts: torch.Tensor  # [P + 1] int64 chunk boundaries, relative to `start`
    context_lens: torch.Tensor  # [P] int64
    max_chunk_len: int
    segments: list[PrefillSegment]  # the same chunks one by one, for the reference ops


@dataclass
class LoraSegments:
    """The prefill chunks as LoRA segments (one chunk, one adapter) for the SGMV-style kernels."""

    starts: torch.Tensor  # [P + 1] int32 rows relative to the first prefill row
    slots: torch.Tensor  # [P] int32 adapter slot of each chunk (-1: the base model)
    longest: int  # rows of the longest chunk, known on the host so launches need no device sync


@dataclass
class LoraBatch:
    """Which adapter each row uses. Slot u is `adapters[u]`; slots are sorted names, so steps with the
    same set of adapters in another order share the stackers' per-set tables."""

    adapters: tuple[str, ...]
    decode_slots: torch.Tensor | None  # [D] int32 slot of each decode row (-1: none); None: no decode has one
    segments: LoraSegments | None  # None: no prefill chunk has an adapter
    # For the grouped GEMMs: the rows that have an adapter, grouped by slot (rows in order within one).
    order: torch.Tensor  # [T_a] int64
    in_row_order: bool  # order is 0 .. T - 1: every row has an adapter, slots ascend with the rows
    slot_counts: list[int]  # [U] on the host: rows of each slot, each at least 1
    slot_counts_device: torch.Tensor  # [U] int32, the same on the device
    slot_ends: torch.Tensor  # [U] int32 cumulative slot_counts: each slot's row end within order


@dataclass
class StepBatch:
    """One step's layout. Every tensor is a view of the step's one metadata copy on the device."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64 page * page_size + offset of each token's KV slot
    # [S + P] int64 rows whose logits are wanted: the S sampled rows in chunk order (padding rows last), then
    # the P rows whose logits score prompt tokens (prompt logprobs), in chunk order
    logits_indices: torch.Tensor
    decode: DecodeBatch | None  # rows [0, D)
    prefill: PrefillBatch | None  # rows [D, T)
    lora: LoraBatch | None  # None: no row has an adapter
    chunk_adapters: list[tuple[int, str | None]] = field(default_factory=list)  # (rows, adapter) per chunk
    num_padding: int = 0  # padding decodes at the end of the decode rows (and of the sampled rows)
    num_scored: int = 0  # P: rows after the sampled ones in logits_indices that score prompt tokens

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_decodes(self) -> int:
        return self.decode.size if self.decode is not None else 0

    @property
    def token_adapters(self) -> list[str | None]:
        """Each row's adapter (None: the base model); expanded on demand, the step itself never needs it."""
        return [adapter for rows, adapter in self.chunk_adapters for _ in range(rows)]


@dataclass
class BuildStats:
    builds: int = 0  # batches built
    uploads: int = 0  # metadata copies to the device: one per build
    allocations: int = 0  # host buffers allocated: grows only while steps get bigger


class _Layout:
    """Offsets of named sections of the step buffer, in int32 units: the int64 sections first."""

    def __init__(self, int64: dict[str, int], int32: dict[str, int]):
        self.spans: dict[str, tuple[int, int, bool]] = {}  # name -> (offset, length, is_int64)
        offset = 0
        for name, length in int64.items():
            self.spans[name] = (offset, length, True)
            offset += 2 * length
        self.int64_end = offset
        for name, length in int32.items():
            self.spans[name] = (offset, length, False)
            offset += length
        self.total = offset

    def arrays(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        wide = flat[: self.int64_end].view(np.int64)
        return {
            name: wide[o // 2 : o // 2 + n] if is64 else flat[o : o + n]
            for name, (o, n, is64) in self.spans.items()
        }

    def tensors(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        wide = flat[: self.int64_end].view(torch.int64)
        return {
            name: wide[o // 2 : o // 2 + n] if is64 else flat[o : o + n]
            for name, (o, n, is64) in self.spans.items()
        }


class BatchBuilder:
    """Builds StepBatches on one device, reusing one host buffer from step to step."""

    def __init__(self, page_size: int, device: torch.device | str, buckets: DecodeBuckets | None = None):
        """`buckets`: lay decode-only steps out graph-ready (see DecodeBuckets); None: exact sizes."""
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        self.page_size = page_size
        self.device = torch.device(device)
        self.buckets = buckets
        self._static: dict[int, torch.Tensor] = {}  # bucket -> its device metadata buffer
        # Pinned memory lets the copy run asynchronously; it needs CUDA, and only helps a CUDA device.
        self._pinned = self.device.type == "cuda" and torch.cuda.is_available()
        self._host = torch.empty(0, dtype=torch.int32)
        self._flat = self._host.numpy()
        # Recorded after each asynchronous copy: the host buffer is rewritten only once the copy read it.
        self._copied = torch.cuda.Event() if self._pinned else None
        self.stats = BuildStats()

    def build(self, chunks: Sequence[StepChunk], scored: Sequence[int] | None = None) -> StepBatch:
        """The batch of `chunks`, laid out as `order_chunks` orders them (decodes first). `scored[i]`: the
        first positions of chunk i whose logits are wanted too (they score prompt tokens), after the
        sampled rows; such a step is never laid out graph-ready."""
        if not chunks:
            raise ValueError("a step needs at least one chunk")
        scored = list(scored) if scored is not None else [0] * len(chunks)
        if len(scored) != len(chunks):
            raise ValueError(f"{len(scored)} scored counts for {len(chunks)} chunks")
        if any(not 0 <= n <= c.num_tokens for n, c in zip(scored, chunks, strict=True)):
            raise ValueError("each scored count must be within its chunk's tokens")
        bucket = self._bucket(chunks) if not any(scored) else None
        num_padding = 0
        if bucket is not None:
            assert self.buckets is not None
            num_padding = bucket - len(chunks)
            padding = _PaddingChunk(_PaddingRequest((self.buckets.padding_page,)))
            chunks = [*chunks, *[padding] * num_padding]
        page_size = self.page_size
        num_decodes = 0
        blocks = []  # pages each chunk's context spans
        for i, chunk in enumerate(chunks):
            if chunk.num_tokens < 1:
                raise ValueError(f"chunk {i} has {chunk.num_tokens} tokens; every chunk needs at least one")
            if chunk.num_tokens == 1:
                if num_decodes != i:
                    raise ValueError("decodes (one-token chunks) must come first: see order_chunks()")
                num_decodes += 1
            blocks.append(-(-chunk.end // page_size))
            if len(chunk.request.pages) < blocks[-1]:
                raise ValueError(
                    f"chunk {i} reaches token {chunk.end}, which needs {blocks[-1]} pages of {page_size}; "
                    f"its request has {len(chunk.request.pages)}"
                )
        decodes, prefills = chunks[:num_decodes], chunks[num_decodes:]
        decode_width = max(blocks[:num_decodes], default=0)
        if bucket is not None:
            assert self.buckets is not None
            if decode_width > self.buckets.max_blocks:
                raise ValueError(
                    f"a decode spans {decode_width} pages, more than the buckets' {self.buckets.max_blocks}"
                )
            decode_width = self.buckets.max_blocks  # one width, one grid, for every step of a bucket
        prefill_width = max(blocks[num_decodes:], default=0)
        names = tuple(sorted({c.request.adapter for c in chunks if c.request.adapter is not None}))
        slot_of = {name: u for u, name in enumerate(names)}
        chunk_slots = [-1 if c.request.adapter is None else slot_of[c.request.adapter] for c in chunks]
        num_tokens = sum(c.num_tokens for c in chunks)
        num_samples = sum(1 for c in chunks if c.samples)
        num_scored = sum(scored)
        lora_rows = sum(c.num_tokens for c, u in zip(chunks, chunk_slots, strict=True) if u >= 0)
        p = len(prefills)
        layout = _Layout(
            int64={
                "input_ids": num_tokens,
                "positions": num_tokens,
                "slots": num_tokens,
                "logits_indices": num_samples + num_scored,
                "decode_tables": num_decodes * decode_width,
                "decode_lens": num_decodes,
                "prefill_tables": p * prefill_width,
                "q_starts": p + 1 if p else 0,
                "prefill_lens": p,
                "lora_order": lora_rows,
                # A bucket reserves lora_order at its largest, so decode_slots (what the LoRA kernels
                # read) sits at one offset for every step of the bucket: a captured graph reads it there.
                "lora_order_reserve": bucket - lora_rows if bucket is not None else 0,
            },
            int32={
                "decode_slots": num_decodes if names else 0,
                "segment_starts": p + 1 if p and names else 0,
                "segment_slots": p if names else 0,
                "slot_counts": len(names),
                "slot_ends": len(names),
            },
        )
        upload = layout.total
        if bucket is not None and self.buckets is not None:
            upload = self.buckets.upload_size(bucket)
            assert upload >= layout.total, "a bucket's fixed copy must hold its largest layout"
        host = self._host_arrays(layout, upload)

        # Tokens, positions, KV slots, sampled rows: one pass over the chunks.
        ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        scored_rows: list[int] = []
        slots = host["slots"]
        row = 0
        for i, (chunk, num_blocks) in enumerate(zip(chunks, blocks, strict=True)):
            if i < len(scored) and scored[i]:
                scored_rows.extend(range(row, row + scored[i]))
            request, start, end = chunk.request, chunk.start, chunk.end
            # A speculative chunk's last tokens are its draft (engine/speculative.py), not the request's yet.
            draft: Sequence[int] = getattr(chunk, "draft", ())
            ids.extend(request.tokens(start, end - len(draft)))
            ids.extend(draft)
            pages = request.pages
            if end - start == 1:
                positions.append(start)
                slots[row] = pages[start // page_size] * page_size + start % page_size
            else:
                positions.extend(range(start, end))
                span = np.arange(start, end)
                table = np.asarray(pages[:num_blocks], dtype=np.int64)
                slots[row : row + end - start] = table[span // page_size] * page_size + span % page_size
            row += end - start
            if chunk.samples:
                logits_rows.append(row - 1)
        host["input_ids"][:] = ids
        host["positions"][:] = positions
        host["logits_indices"][:] = logits_rows + scored_rows

        # Block tables, padded with the zero page (page 0 is reserved and never holds a token).
        host["decode_tables"][:] = _padded(
            [c.request.pages for c in decodes], blocks[:num_decodes], decode_width
        )
        host["decode_lens"][:] = [c.end for c in decodes]
        host["prefill_tables"][:] = _padded(
            [c.request.pages for c in prefills], blocks[num_decodes:], prefill_width
        )
        chunk_starts = [num_decodes]
        for c in prefills:
            chunk_starts.append(chunk_starts[-1] + c.num_tokens)
        if p:
            host["q_starts"][:] = [s - num_decodes for s in chunk_starts]
        host["prefill_lens"][:] = [c.end for c in prefills]

        counts = _slot_counts(chunks, chunk_slots, len(names))
        if names:
            self._fill_lora(host, chunks, chunk_slots, counts, num_decodes, chunk_starts)

        views = layout.tensors(self._upload(upload, bucket))
        batch = self._assemble(
            chunks, views, blocks, num_decodes, decode_width, chunk_starts, names, chunk_slots, counts
        )
        batch.num_padding = num_padding
        batch.num_scored = num_scored
        return batch

    def _bucket(self, chunks: Sequence[StepChunk]) -> int | None:
        """The bucket of a decode-only step when buckets are on; None: lay it out exactly."""
        if self.buckets is None or any(c.num_tokens != 1 for c in chunks):
            return None
        return self.buckets.bucket(len(chunks))

    def _fill_lora(
        self,
        host: dict[str, np.ndarray],
        chunks: Sequence[StepChunk],
        chunk_slots: list[int],
        counts: list[int],
        num_decodes: int,
        chunk_starts: list[int],
    ) -> None:
        host["decode_slots"][:] = chunk_slots[:num_decodes]
        host["segment_slots"][:] = chunk_slots[num_decodes:]
        if len(chunk_starts) > 1:
            host["segment_starts"][:] = [s - num_decodes for s in chunk_starts]
        # Rows grouped by slot: each chunk is a run of rows of one adapter, so this is per chunk, not
        # per token.
        runs: list[list[range]] = [[] for _ in counts]
        row = 0
        for chunk, slot in zip(chunks, chunk_slots, strict=True):
            if slot >= 0:
                runs[slot].append(range(row, row + chunk.num_tokens))
            row += chunk.num_tokens
        order: list[int] = []
        for slot_runs in runs:
            for rows in slot_runs:
                order.extend(rows)
        host["lora_order"][:] = order
        host["slot_counts"][:] = counts
        host["slot_ends"][:] = np.cumsum(counts)

    def _host_arrays(self, layout: _Layout, upload: int) -> dict[str, np.ndarray]:
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy may still be reading the buffer
        if self._host.numel() < upload:
            # Grown to twice what is needed (kept even, for the int64 view): steps vary in size, and
            # a buffer that fits the largest so far is not reallocated again.
            capacity = max(4096, 2 * upload + 2)
            capacity += capacity % 2
            self._host = torch.empty(capacity, dtype=torch.int32, pin_memory=self._pinned)
            self._flat = self._host.numpy()
            self.stats.allocations += 1
        return layout.arrays(self._flat)

    def _upload(self, total: int, bucket: int | None = None) -> torch.Tensor:
        """The filled prefix of the host buffer on the device: the step's one metadata copy. On the CPU
        it is a copy too, so a batch stays valid after the next one is built into the same buffer.
        A graph-ready step (`bucket`) copies into its bucket's one device buffer instead, so every
        step of the bucket reads its metadata at the same addresses (what a captured graph reads);
        its batch is valid until the next step of the bucket (the copy is ordered after the previous
        step's kernels on the stream)."""
        host = self._host[:total]
        if bucket is None:
            device = host.to(self.device, non_blocking=self._pinned, copy=True)
        else:
            if bucket not in self._static:
                self._static[bucket] = torch.empty(total, dtype=torch.int32, device=self.device)
            device = self._static[bucket]
            device.copy_(host, non_blocking=self._pinned)
        if self._copied is not None:
            self._copied.record()
        self.stats.builds += 1
        self.stats.uploads += 1
        return device

    def _assemble(
        self,
        chunks: Sequence[StepChunk],
        views: dict[str, torch.Tensor],
        blocks: list[int],
        num_decodes: int,
        decode_width: int,
        chunk_starts: list[int],
        names: tuple[str, ...],
        chunk_slots: list[int],
        counts: list[int],
    ) -> StepBatch:
        decode = None
        if num_decodes:
            tables = views["decode_tables"].view(num_decodes, decode_width)
            decode = DecodeBatch(tables, views["decode_lens"], blocks[:num_decodes])
        prefill = None
        prefills = chunks[num_decodes:]
        if prefills:
            width = max(blocks[num_decodes:])
            tables = views["prefill_tables"].view(len(prefills), width)
            segments = [
                PrefillSegment(start, start + c.num_tokens, c.end, tables[i, : blocks[num_decodes + i]])
                for i, (c, start) in enumerate(zip(prefills, chunk_starts[:-1], strict=True))
            ]
            prefill = PrefillBatch(
                start=num_decodes,
                block_tables=tables,
                q_starts=views["q_starts"],
                context_lens=views["prefill_lens"],
                max_chunk_len=max(c.num_tokens for c in prefills),
                segments=segments,
            )
        lora = None
        if names:
            lora_segments = None
            if any(u >= 0 for u in chunk_slots[num_decodes:]):
                longest = max(c.num_tokens for c in prefills)
                lora_segments = LoraSegments(views["segment_starts"], views["segment_slots"], longest)
            lora = LoraBatch(
                adapters=names,
                decode_slots=(
                    views["decode_slots"] if any(u >= 0 for u in chunk_slots[:num_decodes]) else None
                ),
                segments=lora_segments,
                order=views["lora_order"],
                in_row_order=all(u >= 0 for u in chunk_slots) and chunk_slots == sorted(chunk_slots),
                slot_counts=counts,
                slot_counts_device=views["slot_counts"],
                slot_ends=views["slot_ends"],
            )
        return StepBatch(
            input_ids=views["input_ids"],
            positions=views["positions"],
            slots=views["slots"],
            logits_indices=views["logits_indices"],
            decode=decode,
            prefill=prefill,
            lora=lora,
            chunk_adapters=[(c.num_tokens, c.request.adapter) for c in chunks],
        )


def _padded(tables: Sequence[Sequence[int]], widths: list[int], widest: int) -> list[int]:
    """Each table cut to its width and padded with the zero page to `widest`, flattened."""
    flat: list[int] = []
    for pages, width in zip(tables, widths, strict=True):
        flat.extend(pages[:width])
        flat.extend([0] * (widest - width))
    return flat


def _slot_counts(chunks: Sequence[StepChunk], chunk_slots: list[int], num_slots: int) -> list[int]:
    counts = [0] * num_slots
    for chunk, slot in zip(chunks, chunk_slots, strict=True):
        if slot >= 0:
            counts[slot] += chunk.num_tokens
    return counts
