"""The only part of the engine that touches the device: lays a step's chunks out and runs the model.

The layout and its metadata are engine/batch.py's (one host buffer, one copy per step); the runner
keeps the builder, picks the attention implementation, asks the LoRA stacker for the step's LoRA work
and runs the model for the logits of the rows that sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .attention import ReferenceAttention, TritonAttention
from .batch import BatchBuilder, Chunk, StepBatch, StepChunk, order_chunks
from .kv_cache import KVCache
from .lora.step import KernelLoraStacker, LoraStacker
from .model.llama import LlamaModel


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
        self.builder = BatchBuilder(cache.page_size, self.device)

    def order(self, chunks: Sequence[Chunk]) -> list[Chunk]:
        """Decodes first, longest context first, then prefill chunks: the layout `build` expects."""
        return order_chunks(chunks)

    def build(self, chunks: Sequence[StepChunk]) -> StepBatch:
        return self.builder.build(chunks)

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Float32 logits [S, vocab] for the batch's sampled rows, in chunk order."""
        attention_type = TritonAttention if self.use_kernels else ReferenceAttention
        attention = attention_type(self.cache.memory, batch, self.scale)
        lora = self.lora.build(batch) if self.lora is not None else None
        return self.model(batch.input_ids, batch.positions, attention, batch.logits_indices, lora)
