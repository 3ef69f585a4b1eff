"""Device memory of the page pool, seen as a paged KV cache.

One tensor [layers, 2, kv_heads, num_pages, page_size, head_dim]: page p holds keys and values of
`page_size` tokens in every layer and head. Per layer, keys (and values) of all pages are contiguous,
so a batch's cache rows are one gather away (see kernels/reference.py for why heads come first).
"""

from __future__ import annotations

import torch

from .model.config import ModelConfig


def page_bytes(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return config.num_layers * 2 * page_size * config.num_kv_heads * config.head_dim * element


class KVCache:
    def __init__(
        self, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device
    ):
        self.page_size = page_size
        self.num_pages = num_pages
        # Zeros, not empty: padded attention reads masked rows, and 0 * NaN would poison the output.
        self.memory = torch.zeros(
            config.num_layers,
            2,
            config.num_kv_heads,
            num_pages,
            page_size,
            config.head_dim,
            dtype=dtype,
            device=device,
        )

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer, each [kv_heads, num_pages, page_size, head_dim]."""
        return self.memory[index, 0], self.memory[index, 1]
