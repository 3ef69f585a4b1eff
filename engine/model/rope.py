"""Rotary position embeddings' tables, computed the way Hugging Face Llama does so outputs match bit for
bit. Applying them is `kernels/reference.apply_rotary` (the CPU path) or, on the kernel path, part of the
KV write (`kernels/write_kv.rotary_write_kv`)."""

from __future__ import annotations

import math

import torch

from .config import ModelConfig, RopeScaling


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, with Llama 3 scaling when the config asks for it."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_table(
    config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position, each [max_positions, head_dim], cast to the model dtype."""
    inv_freq = inverse_frequencies(config)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2], one multiply per entry as HF's matmul
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)
