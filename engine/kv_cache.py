"""Device memory of the page pool, seen as a paged KV cache.

One tensor [num_pages, layers, 2, kv_heads, page_size, head_dim]: page-major, so every page is one
contiguous block of memory. As KV, page p holds keys and values of `page_size` tokens in every layer
and head; the same block can instead hold adapter weights (S-LoRA's unified paging), which is why a
page must be contiguous. kernels/reference.py reads and writes it by computed row indices.
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
            num_pages, config.num_layers, 2, config.num_kv_heads, page_size, config.head_dim,
            dtype=dtype, device=device,
        )  # fmt: skip

    def pages(self) -> torch.Tensor:
        """The pool as [num_pages, page_elements]: what adapter weights are stored in."""
        return self.memory.view(self.num_pages, -1)
