"""The only part of the engine that touches the device: lays a step's chunks out and runs the model.

The layout and its metadata are engine/batch.py's (one host buffer, one copy per step); the runner
keeps the builder, picks the attention implementation, asks the LoRA stacker for the step's LoRA work
and runs the model for the logits of the rows that sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .attention import ReferenceAttention, TritonAttention
from .batch import BatchBuilder, Chunk, DecodeBuckets, StepBatch, StepChunk, order_chunks
from .graphs import DecodeGraphs, tensor_key
from .kv_cache import KVCache
from .lora.step import KernelLoraStacker, KernelLoraStep, LoraStacker, LoraStep
from .model.llama import LlamaModel


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        lora: LoraStacker | KernelLoraStacker | None = None,
        use_kernels: bool = False,
        buckets: DecodeBuckets | None = None,
        graphs: DecodeGraphs | None = None,
    ):
        """`use_kernels`: attention and LoRA through the Triton kernels (CUDA, or the CPU interpreter)
        instead of the plain-torch reference ops. `buckets`: decode-only steps graph-ready (padded to
        fixed shapes per batch-size bucket, engine/batch.py). `graphs`: replay those steps from captured
        graphs (engine/graphs.py); needs `buckets` and the kernels, whose launches read only device
        buffers."""
        if graphs is not None and (buckets is None or not use_kernels):
            raise ValueError("decode graphs need graph-ready buckets and the Triton kernels")
        self.model = model
        self.cache = cache
        self.lora = lora
        self.use_kernels = use_kernels
        self.device = model.device
        self.scale = model.config.head_dim**-0.5
        self.builder = BatchBuilder(cache.page_size, self.device, buckets)
        self.graphs = graphs

    def order(self, chunks: Sequence[Chunk]) -> list[Chunk]:
        """Decodes first, longest context first, then prefill chunks: the layout `build` expects."""
        return order_chunks(chunks)

    def build(self, chunks: Sequence[StepChunk]) -> StepBatch:
        return self.builder.build(chunks)

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Float32 logits [S, vocab] for the batch's sampled rows, in chunk order (padding rows, if
        any, last). Reads no device value on the host: nothing here waits for the device."""
        lora = self.lora.build(batch) if self.lora is not None else None
        bucket = self._bucket(batch)
        if self.graphs is not None and bucket is not None:
            return self.graphs.run(self._graph_key(batch, bucket), self._forward(batch, lora), keep=(lora,))
        return self._forward(batch, lora)()

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
