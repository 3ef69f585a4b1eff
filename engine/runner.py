"""The only part of the engine that touches the device: lays a step's chunks out, runs the model,
checks and samples its logits, and answers what the engine asks of the device (free memory, zeroed pages).

The layout and its metadata are engine/batch.py's (one host buffer, one copy per step); the runner
keeps the builder, picks the attention implementation, asks the LoRA stacker for the step's LoRA work
and runs the model for the logits of the rows that sample. `forward` reads no device value on the host
(a pipelined step's decodes take their ids from the step in flight's tokens, on the device), `sample`
queues the draw and returns a `StepHandle`, whose one device-to-host copy is made when it is read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .attention import ReferenceAttention, TritonAttention
from .batch import BatchBuilder, Chunk, DecodeBuckets, StepBatch, StepChunk, order_chunks
from .compiled_decode import CompiledDecode, LoraStacks, NotCompiled, make_stacks
from .graphs import DecodeGraphs, tensor_key
from .kv_cache import KVCache
from .lora.step import KernelLoraStacker, KernelLoraStep, LoraStacker, LoraStep
from .model.llama import LlamaModel
from .penalties import PenaltyStore
from .prompt_logprobs import PromptScores, scored_rows
from .request import Request
from .sampler import DraftLogits, StepSample, sample_step
from .scheduler import ScheduledChunk, StepPlan

log = logging.getLogger(__name__)


class NonFiniteLogits(RuntimeError):
    """A step produced NaN or infinite logits for some of its requests (`request_ids`)."""

    def __init__(self, request_ids: list[str]):
        super().__init__(f"the logits of {', '.join(request_ids[:8])} are not finite")
        self.request_ids = frozenset(request_ids)


@dataclass
class StepHandle:
    """A launched step whose tokens are not read yet: its plan, its sampled tokens on the device, and each
    sampling request's row among them. `check` and `tokens` share the step's one device-to-host copy; the
    prompt logprobs of echo requests (`scores`, usually none) have a copy of their own."""

    plan: StepPlan
    sampled: StepSample
    scores: PromptScores = field(default_factory=PromptScores.none)
    rows: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.rows = {request.request_id: i for i, request in enumerate(self.plan.sampling)}

    def check(self) -> None:
        """NonFiniteLogits if a row's logits were not finite (read before any token lands)."""
        check_finite(self.plan.chunks, self.sampled.finite())

    def tokens(self) -> list[int]:
        """The sampled ids (logprobs, prompt logprobs and kept logits land on their requests)."""
        self.scores.land()
        return self.sampled.resolve()

    def accepted(self) -> list[int] | None:
        """How many draft tokens of each sampling row held (None: the step had no draft), after tokens()."""
        return self.sampled.accepted()


def check_finite(chunks: Sequence[ScheduledChunk], flags: list[bool]) -> None:
    """NonFiniteLogits naming the sampling requests whose flag (one per sampled row) is False."""
    if not all(flags):
        sampled = [c.request.request_id for c in chunks if c.samples]
        raise NonFiniteLogits([sampled[i] for i, ok in enumerate(flags) if not ok])


def free_device_bytes(device: torch.device) -> int:
    """Bytes free on a CUDA device now (what the pool may take a share of)."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        lora: LoraStacker | KernelLoraStacker | None = None,
        use_kernels: bool = False,
        buckets: DecodeBuckets | None = None,
        graphs: DecodeGraphs | None = None,
        compiled: CompiledDecode | None = None,
    ):
        """`use_kernels`: attention and LoRA through the Triton kernels (CUDA, or the CPU interpreter)
        instead of the plain-torch reference ops. `buckets`: decode-only steps graph-ready (padded to
        fixed shapes per batch-size bucket, engine/batch.py). `graphs`: replay those steps from captured
        graphs (engine/graphs.py); needs `buckets` and the kernels, whose launches read only device
        buffers. `compiled`: run those steps through the compiled decode step instead (the CPU,
        engine/compiled_decode.py); a step it has no graph for runs eagerly."""
        if graphs is not None and (buckets is None or not use_kernels):
            raise ValueError("decode graphs need graph-ready buckets and the Triton kernels")
        if compiled is not None and (
            buckets is None or use_kernels or (lora is not None and not isinstance(lora, LoraStacker))
        ):
            raise ValueError("the compiled decode step needs graph-ready buckets and the torch path")
        self.model = model
        self.cache = cache
        self.lora = lora
        self.use_kernels = use_kernels
        self.device = model.device
        self.scale = model.config.head_dim**-0.5
        self.builder = BatchBuilder(cache.page_size, self.device, buckets)
        self.graphs = graphs
        self.compiled = compiled
        self._compiled_stacks: tuple[object, LoraStacks] | None = None  # the last set's (see _stacks)
        # The penalised requests' output tokens, kept on the device between steps (engine/penalties.py).
        self.penalties = PenaltyStore(model.config.vocab_size, self.device)

    def order(self, chunks: Sequence[Chunk]) -> list[Chunk]:
        """Decodes first, longest context first, then prefill chunks: the layout `build` expects."""
        return order_chunks(chunks)

    def build(self, chunks: Sequence[StepChunk], scored: Sequence[int] | None = None) -> StepBatch:
        return self.builder.build(chunks, scored)

    # -- a step -------------------------------------------------------------------------------------

    def forward(
        self, chunks: Sequence[ScheduledChunk], feed: StepHandle | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, PromptScores, DraftLogits | None]:
        """The chunks' sampled rows' logits [S, vocab], whether each row is finite [S], the scoring of the
        prompt tokens of the echo requests that ask (queued; usually none) and the logits of the draft
        positions of speculative chunks (None: the step has none), all still on the device: from the
        metadata copy to here nothing reads a device value, so nothing waits for the device (what a
        captured CUDA graph of the decode step needs; tests/engine/test_dispatch.py). `feed`: the step in
        flight, whose sampled tokens are this step's pending ids. The padding rows of a graph-ready step
        are computed with the rest and dropped here (views). A speculative row is finite only if its
        draft positions are too."""
        prompt = [scored_rows(chunk) for chunk in chunks]
        drafted = [len(chunk.draft) for chunk in chunks]
        # Both kinds of extra rows are a chunk's first positions (a drafting request scores no prompt).
        extra = [p + d for p, d in zip(prompt, drafted, strict=True)]
        batch = self.build(chunks, extra) if any(extra) else self.build(chunks)
        if feed is not None:
            self._feed(batch.input_ids, chunks, feed)
        logits = self.execute(batch)  # [S + padding + P, vocab]
        sampled = logits.shape[0] - batch.num_scored
        rest = logits[sampled:]
        drafts = None
        if any(drafted):
            rest, drafts = self._split_drafts(rest, chunks, prompt, drafted)
        scores = PromptScores.queue(rest, chunks, prompt) if any(prompt) else PromptScores.none()
        logits = logits[:sampled]
        finite = torch.isfinite(logits).all(dim=-1)  # over every sampled row: one shape per bucket
        if drafts is not None:
            finite = finite & self._drafts_finite(drafts, chunks, sampled)
        real = sampled - batch.num_padding
        return logits[:real], finite[:real], scores, drafts

    @staticmethod
    def _split_drafts(
        rest: torch.Tensor, chunks: Sequence[ScheduledChunk], prompt: list[int], drafted: list[int]
    ) -> tuple[torch.Tensor, DraftLogits]:
        """The extra rows [P + K, V] (chunk order) parted into the prompt-scoring rows and the drafts'."""
        draft_chunks = [c for c in chunks if c.draft]
        if not any(prompt):
            return rest[:0], DraftLogits(
                [c.request for c in draft_chunks], [c.draft for c in draft_chunks], rest
            )
        prompt_rows: list[int] = []
        draft_rows: list[int] = []
        row = 0
        for p, d in zip(prompt, drafted, strict=True):
            prompt_rows.extend(range(row, row + p))
            draft_rows.extend(range(row + p, row + p + d))
            row += p + d
        device = rest.device
        take = torch.tensor(prompt_rows + draft_rows, dtype=torch.int64).to(device, non_blocking=True)
        parted = rest.index_select(0, take)
        draft_logits = parted[len(prompt_rows) :]
        requests = [c.request for c in draft_chunks]
        return parted[: len(prompt_rows)], DraftLogits(
            requests, [c.draft for c in draft_chunks], draft_logits
        )

    @staticmethod
    def _drafts_finite(drafts: DraftLogits, chunks: Sequence[ScheduledChunk], sampled: int) -> torch.Tensor:
        """[sampled] bool: False for the sampled row of a speculative chunk with a draft row not finite."""
        owner: list[int] = []
        row = 0
        for chunk in chunks:
            if chunk.draft:
                owner.extend([row] * len(chunk.draft))
            row += chunk.samples
        device = drafts.logits.device
        index = torch.tensor(owner, dtype=torch.int64).to(device, non_blocking=True)
        bad = (~torch.isfinite(drafts.logits).all(dim=-1)).float()
        return torch.zeros(sampled, device=device).index_add_(0, index, bad) == 0

    def checked_logits(
        self, chunks: Sequence[ScheduledChunk]
    ) -> tuple[torch.Tensor, PromptScores, DraftLogits | None]:
        """Logits [S, vocab] of the chunks' sampled rows, their prompt scores and draft rows;
        NonFiniteLogits if any sampled row is not finite. Reads the finite flags at once (a copy of its
        own): the fault path's forward."""
        logits, finite, scores, drafts = self.forward(chunks)
        check_finite(chunks, finite.tolist())
        return logits, scores, drafts

    def sample(
        self,
        plan: StepPlan,
        logits: torch.Tensor,
        finite: torch.Tensor | None = None,
        rows: list[int] | None = None,
        scores: PromptScores | None = None,
        drafts: DraftLogits | None = None,
    ) -> StepHandle:
        """Queue the draw of the plan's sampling requests' next tokens from logits [S, vocab] (`rows`:
        only these rows of it, in order, one per sampling request); `finite` [S] rides in the same copy;
        `scores`: the same forward's prompt scores, which land with the tokens; `drafts`: its speculative
        rows, verified here (a request left out of the plan is left out of them too)."""
        if rows is not None:
            index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            logits = logits.index_select(0, index)
            finite = None if finite is None else finite.index_select(0, index)
        sampled = sample_step(logits, plan.sampling, finite, self.penalties, drafts)
        return StepHandle(plan, sampled, scores or PromptScores.none())

    def sampling_failure(self, logits: torch.Tensor, row: int, request: Request) -> str | None:
        """Why sampling row `row` of logits [S, vocab] for `request` alone raises (None: it does not), up
        to the copy to the host, where a device reports its errors. A penalised row writes the token it
        draws where the step's draw writes it again (engine/penalties.py): trying it counts nothing twice."""
        try:
            sample_step(logits[row : row + 1], [request], penalties=self.penalties).wait()
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        return None

    def zero_pages(self, pages: Sequence[int]) -> None:
        """Write zeros over the pages' keys and values (page-major): a failed request's pages may hold NaN,
        and a page reused by another request is read beyond its own tokens too (masked, but NaN times
        zero is NaN)."""
        self.cache.memory[list(pages)] = 0

    def _feed(self, input_ids: torch.Tensor, chunks: Sequence[ScheduledChunk], feed: StepHandle) -> None:
        """Copy the pending tokens' ids from the step in flight's sampled tokens into this step's input
        rows, on the device: each is a decode (one-token chunk, laid out first) of a pending position."""
        rows = feed.rows
        pairs = [
            (row, rows[chunk.request.request_id])
            for row, chunk in enumerate(chunks)
            if chunk.num_tokens == 1 and chunk.start >= chunk.request.num_known_tokens
        ]
        if not pairs:
            return
        index = torch.tensor(pairs, dtype=torch.int64).T  # [2, k]: this step's rows, the flight's rows
        if input_ids.device.type == "cuda":
            index = index.pin_memory().to(input_ids.device, non_blocking=True)
        tokens = feed.sampled.tokens.index_select(0, index[1]).to(input_ids.dtype)
        input_ids.index_copy_(0, index[0], tokens)

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Float32 logits [S, vocab] for the batch's sampled rows, in chunk order (padding rows, if
        any, last). Reads no device value on the host: nothing here waits for the device."""
        bucket = self._bucket(batch)
        if self.compiled is not None and bucket is not None:
            logits = self._compiled(batch, self.compiled)
            if logits is not None:
                return logits
        lora = self.lora.build(batch) if self.lora is not None else None
        if self.graphs is not None and bucket is not None:
            return self.graphs.run(self._graph_key(batch, bucket), self._forward(batch, lora), keep=(lora,))
        return self._forward(batch, lora)()

    def _compiled(self, batch: StepBatch, compiled: CompiledDecode) -> torch.Tensor | None:
        """The logits of a graph-ready decode step from the compiled step; None: run it eagerly (a DoRA
        adapter in the step, or no graph for it)."""
        stacks = None
        if batch.lora is not None and batch.lora.decode_slots is not None:
            if self.lora is None:
                return None
            stacks = self._stacks(batch.lora.adapters)
            if stacks is None:
                return None
        try:
            return compiled.run(batch, stacks)
        except NotCompiled as error:
            if compiled.fallbacks == 1:
                log.warning("a decode step ran eagerly: the compiled step has no graph for it (%s)", error)
            return None

    def _stacks(self, adapters: tuple[str, ...]) -> LoraStacks | None:
        """The compiled step's stacks of an adapter set, made once per set of the stacker's (its stacks
        are the same object until the set or an adapter's pages change); None with a DoRA adapter."""
        assert isinstance(self.lora, LoraStacker)
        source = self.lora.stacks(adapters)
        if self._compiled_stacks is not None and self._compiled_stacks[0] is source:
            return self._compiled_stacks[1]
        if any(stack.scale is not None for stack in source.values()):
            return None
        model = self.model.config
        stacks = make_stacks(source, len(adapters), self.lora.widths(), model.num_layers, self.lora.dtype)
        self._compiled_stacks = (source, stacks)
        return stacks

    def _forward(
        self, batch: StepBatch, lora: LoraStep | KernelLoraStep | None
    ) -> Callable[[], torch.Tensor]:
        attention_type = TritonAttention if self.use_kernels else ReferenceAttention
        attention = attention_type(self.cache.memory, batch, self.scale)
        model = self.model

        def forward() -> torch.Tensor:
            return model(batch.input_ids, batch.positions, attention, batch.logits_indices, lora)

        return forward

    def _bucket(self, batch: StepBatch) -> int | None:
        """The bucket of a graph-ready (decode-only, padded) batch; None for any other."""
        buckets = self.builder.buckets
        if (
            buckets is None
            or batch.prefill is not None
            or batch.num_scored  # a decode-shaped step that also scores prompt tokens is not a graph's
            or buckets.bucket(batch.num_decodes) != batch.num_decodes
        ):
            return None
        return batch.num_decodes

    def _graph_key(self, batch: StepBatch, bucket: int) -> tuple[object, ...]:
        """What a captured decode step read: the batch's views of its bucket buffer, and the LoRA
        work's adapter set, residency version and persistent table addresses (engine/graphs.py)."""
        decode = batch.decode
        assert decode is not None
        lora = batch.lora
        views = tensor_key(
            batch.input_ids,
            batch.positions,
            batch.slots,
            batch.logits_indices,
            decode.block_tables,
            decode.context_lens,
            lora.decode_slots if lora is not None else None,
        )
        adapters: tuple[object, ...] = ()
        if lora is not None and self.lora is not None:
            residency = self.lora.residency
            tables = residency.tables.groups
            addresses = tuple(
                (group, tensor_key(t.a_starts, t.b_starts, t.b_cols, t.b_widths))
                for group, t in tables.items()
            )
            adapters = (lora.adapters, residency.version, addresses)
        return (bucket, views, adapters)
