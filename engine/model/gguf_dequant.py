"""Whole-tensor dequantization of the GGUF block formats the default model uses (Q4_0, Q4_1, Q8_0), in a
few numpy operations per tensor.

The `gguf` package's `dequantize` decodes the same formats in row groups (thousands of small numpy calls a
tensor): 9 of a SmolLM2 load's 17 seconds went there, paid by every process that loads the model (each
engine, server, pod and test worker). Any other type goes to `gguf.quants.dequantize` as before; a test
holds these decoders to it bit for bit.
"""

from __future__ import annotations

import numpy as np

# Block layouts (32 weights a block): Q4_0 fp16 d, 16 bytes of nibbles, w = d (q - 8); Q4_1 fp16 d, fp16 m,
# 16 bytes, w = d q + m; Q8_0 fp16 d, 32 int8, w = d q. In the nibble formats byte j of a block holds
# weight j in its low nibble and weight j + 16 in its high nibble.
BLOCK = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def fast_types() -> frozenset[str]:
    return frozenset(_BLOCK_BYTES)


def _halves(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at bytes [start, start + 2) of every block, as a float32 column."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def dequantize_blocks(raw: np.ndarray, kind: str) -> np.ndarray:
    """The float32 weights, flat and in file order, of `raw` (the tensor's bytes) in block format `kind`."""
    size = _BLOCK_BYTES[kind]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, size)
    d = _halves(blocks, 0)
    if kind == "Q8_0":
        return (blocks[:, 2:].view(np.int8).astype(np.float32) * d).reshape(-1)
    qs = blocks[:, 4:] if kind == "Q4_1" else blocks[:, 2:]
    codes = np.concatenate((qs & 0x0F, qs >> 4), axis=1).astype(np.float32)
    if kind == "Q4_1":
        return (codes * d + _halves(blocks, 2)).reshape(-1)
    return ((codes - 8.0) * d).reshape(-1)
