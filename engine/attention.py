"""The attention callables the model calls per layer for one step: plain torch, or Triton kernels.

Both store the step's new keys and values in the pool and then attend: decodes (one token each) to
their cached contexts, prefill chunks causally to their cached prefix and themselves. Both read the
one layout of engine/batch.py: the torch path takes views of it, decodes in groups of similar length
(a padded gather is wasted work on a CPU) and prefill chunks one by one; the kernels walk each
sequence's own pages, so one launch serves all decodes and one all prefill chunks.
"""

from __future__ import annotations

import torch

from .batch import StepBatch
from .kernels import reference


class ReferenceAttention:
    def __init__(self, memory: torch.Tensor, batch: StepBatch, scale: float):
        self.memory = memory
        self.batch = batch
        self.scale = scale
        # Derived once per step, not per layer.
        self.decode_groups = batch.decode.groups() if batch.decode is not None else []
        self.segments = batch.prefill.segments if batch.prefill is not None else []

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        memory = self.memory
        reference.write_kv(memory, layer, k, v, self.batch.slots)
        parts = [
            reference.paged_decode_attention(
                q[g.start : g.end], memory, layer, g.block_tables, g.context_lens, self.scale
            )
            for g in self.decode_groups
        ]
        for seg in self.segments:
            rows = slice(seg.start, seg.end)
            if seg.fresh:
                parts.append(reference.causal_attention(q[rows], k[rows], v[rows], self.scale))
            else:
                parts.append(
                    reference.prefill_attention(
                        q[rows], memory, layer, seg.block_table, seg.context_len, self.scale
                    )
                )
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class TritonAttention:
    def __init__(self, memory: torch.Tensor, batch: StepBatch, scale: float):
        # Imported here: the CPU path never needs Triton, and importing it costs a second.
        from .kernels import paged_decode_attention, prefill_attention, write_kv
        from .model.layer_ops import kernel_ops

        self._write_kv = write_kv.write_kv
        self._rotary_write_kv = write_kv.rotary_write_kv
        # The model's norms and activation go through kernels too, and q, k come unrotated (rope=...).
        self.layer_ops = kernel_ops()
        self._decode = paged_decode_attention.paged_decode_attention
        self._prefill = prefill_attention.prefill_attention_varlen
        self.memory = memory
        self.batch = batch
        self.scale = scale

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        b, memory = self.batch, self.memory
        if rope is None:
            self._write_kv(memory, layer, k, v, b.slots)
        else:  # one launch rotates q and k in place and stores k and v
            self._rotary_write_kv(memory, layer, q, k, v, b.slots, *rope)
        out = torch.empty_like(q)
        decode = b.decode
        if decode is not None:
            rows = slice(0, decode.size)
            out[rows] = self._decode(
                q[rows], memory, layer, decode.block_tables, decode.context_lens, self.scale
            )
        varlen = b.prefill
        if varlen is not None:
            rows = slice(varlen.start, q.shape[0])
            out[rows] = self._prefill(
                q[rows],
                memory,
                layer,
                varlen.block_tables,
                varlen.q_starts,
                varlen.context_lens,
                self.scale,
                max_chunk_len=varlen.max_chunk_len,
            )
        return out
