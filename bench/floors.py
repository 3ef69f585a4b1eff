"""The two floors of a workload on this machine: arithmetic over the measured matmul rate, bytes over
the measured copy bandwidth. No implementation runs much faster than the larger of the two."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex.engine.model.config import ModelConfig


def _median_seconds(fn: Callable[[], object], repeats: int = 9) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def matmul_rate(rows: int, config: ModelConfig, dtype: torch.dtype) -> float:
    """FLOP/s of the model's widest projection (hidden -> 2 * intermediate) at `rows` tokens."""
    x = torch.randn(rows, config.hidden_size, dtype=dtype)
    w = torch.randn(2 * config.intermediate_size, config.hidden_size, dtype=dtype)
    seconds = _median_seconds(lambda: F.linear(x, w))
    return 2 * rows * config.hidden_size * 2 * config.intermediate_size / seconds


def copy_bandwidth(megabytes: int = 256) -> float:
    """Bytes/s of a large copy, counting bytes read plus bytes written."""
    src = torch.randn(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _median_seconds(lambda: dst.copy_(src), repeats=5)


@dataclass
class Floors:
    prefill_seconds: float
    decode_seconds: float

    @property
    def total(self) -> float:
        return self.prefill_seconds + self.decode_seconds


def offline_floors(
    config: ModelConfig, prompt_lens: list[int], new_tokens: int, dtype: torch.dtype
) -> tuple[Floors, dict[str, float]]:
    """Floors of prefilling every prompt once and decoding all requests together, one token a step."""
    element = torch.empty((), dtype=dtype).element_size()
    layer_params = config.num_parameters() - config.vocab_size * config.hidden_size * (
        1 if config.tie_word_embeddings else 2
    )
    head_params = config.vocab_size * config.hidden_size
    kv_per_token = 2 * config.num_layers * config.kv_size  # elements of K and V per cached token
    attention_per_pair = 4 * config.num_layers * config.q_size  # QK^T and PV flops per (query, key) pair

    prefill_rate = matmul_rate(1024, config, dtype)
    batch = len(prompt_lens)
    decode_rate = matmul_rate(batch, config, dtype)
    bandwidth = copy_bandwidth()

    prefill_flops = sum(
        2 * n * layer_params + attention_per_pair * n * (n + 1) / 2 + 2 * head_params for n in prompt_lens
    )
    prefill = prefill_flops / prefill_rate
    decode = 0.0
    for step in range(1, new_tokens):
        contexts = [n + step for n in prompt_lens]
        flops = batch * 2 * (layer_params + head_params) + attention_per_pair * sum(contexts)
        # Weights once per step, and every cached key and value once.
        bytes_moved = (layer_params + head_params + kv_per_token * sum(contexts)) * element
        decode += max(flops / decode_rate, bytes_moved / bandwidth)
    rates = {
        "prefill_gflops": prefill_rate / 1e9,
        "decode_gflops": decode_rate / 1e9,
        "copy_gbps": bandwidth / 1e9,
    }
    return Floors(prefill, decode), rates


# Peak rates of GPUs the step benchmark may meet (dense fp16/bf16 tensor-core FLOP/s, HBM bytes/s), from
# the vendors' datasheets; a device not listed is measured instead (`copy_bandwidth` / `matmul_rate`).
DEVICE_PEAKS: dict[str, tuple[float, float]] = {
    "H100": (989e12, 3.35e12),  # SXM5
    "H200": (989e12, 4.8e12),
    "A100": (312e12, 2.0e12),  # SXM4 80 GB
}


@dataclass
class StepCost:
    """Counted bytes read and FLOPs of one decode step (one new token for each of `batch` requests)."""

    batch: int
    weight_bytes: int  # every linear layer's weights and the head, read once per step
    kv_bytes: int  # every cached key and value of every request
    adapter_bytes: int  # A and B of every adapter the step uses
    flops: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.adapter_bytes

    def floor_seconds(self, flops_per_second: float, bytes_per_second: float) -> float:
        return max(self.flops / flops_per_second, self.bytes / bytes_per_second)


def decode_step_cost(
    config: ModelConfig, batch: int, context: int, element: int, adapters: int, rank: int
) -> StepCost:
    """The decode step of `batch` requests with `context` cached tokens each, `adapters` distinct
    adapters of `rank` on q, k, v and o in every layer (the engine's default targets). Embedding rows
    and norms are left out (a few KB)."""
    head = config.vocab_size * config.hidden_size
    layer_params = config.num_parameters() - config.vocab_size * config.hidden_size * (
        1 if config.tie_word_embeddings else 2
    )
    kv_per_token = 2 * config.num_layers * config.kv_size
    # (in, out) of q, k, v, o: A is [rank, in], B is [out, rank].
    modules = [
        (config.hidden_size, config.q_size),
        (config.hidden_size, config.kv_size),
        (config.hidden_size, config.kv_size),
        (config.q_size, config.hidden_size),
    ]
    lora_params = config.num_layers * sum(rank * (i + o) for i, o in modules)
    attention = 4 * config.num_layers * config.q_size * context  # QK^T and PV per request
    flops = batch * (2 * (layer_params + head) + attention + 2 * lora_params)
    return StepCost(
        batch=batch,
        weight_bytes=(layer_params + head) * element,
        kv_bytes=batch * context * kv_per_token * element,
        adapter_bytes=min(adapters, batch) * lora_params * element,
        flops=flops,
    )
