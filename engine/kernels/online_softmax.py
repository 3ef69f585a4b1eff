"""The online softmax both attention kernels run over their key tiles (flash attention's forward pass).

Decode (paged_decode_attention.py) and prefill (prefill_attention.py) differ in which query rows a
program holds and which keys each row may see; once a tile's scores are masked, folding it into the
running maximum, sum and output is the same, and lives here once. Scores are in log2 units (scaled by
log2(e)) so the exponentials are exp2. Triton inlines the helper into each kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(
    s, v_ptrs, kv_mask, m, row_sum, acc, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr
):
    """Fold one key tile into the running softmax. s [ROWS, BLOCK_N] float32 scores, -inf where a key
    is hidden (every row sees at least one key by the first tile, so m is finite from then on);
    v_ptrs / kv_mask [BLOCK_N, BLOCK_D] the tile's values; m, row_sum [ROWS] and acc [ROWS, BLOCK_D]
    the running maximum, sum of exponentials and unnormalised output. Returns them updated."""
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    row_sum = row_sum * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    # p is rounded to the cache's dtype first, as the GPU's half-precision matmul needs.
    p = p.to(v.dtype).to(DOT_DTYPE)
    acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision=PRECISION)
    return m_new, row_sum, acc
