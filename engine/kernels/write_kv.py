"""Store one layer's new keys and values in their pool slots, in Triton.

Same signature and semantics as `reference.write_kv`: one program per new token copies its
[kv_heads, head_dim] keys and values into page slots[t] // page_size at offset slots[t] % page_size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    slots_ptr,
    memory_ptr,
    layer,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_page,
    stride_layer,
    stride_part,
    stride_head,
    stride_off,
    KV_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    base = (slot // PAGE_SIZE) * stride_page + layer * stride_layer + (slot % PAGE_SIZE) * stride_off
    dst = memory_ptr + base + h[:, None] * stride_head + d[None, :]  # keys; values are stride_part on
    k = tl.load(k_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(dst, k.to(memory_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_part, v.to(memory_ptr.dtype.element_ty), mask=mask)


def write_kv(memory: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store new keys and values of one layer in their slots.

    Shapes: memory [num_pages, layers, 2, kv_heads, page_size, head_dim] (contiguous);
    k, v [T, kv_heads, head_dim]; slots [T] int64.
    Semantics: memory[slots[t] // P, layer, 0, h, slots[t] % P] = k[t, h] (1 and v for values).
    """
    num_tokens, kv_heads, dim = k.shape
    page_size = memory.shape[4]
    assert memory.is_contiguous(), "the pool must be contiguous"
    assert k.stride(2) == 1 and v.stride(2) == 1, "head_dim must be the contiguous axis of k and v"
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        slots,
        memory,
        layer,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *memory.stride()[:5],
        KV_HEADS=kv_heads,
        BLOCK_H=triton.next_power_of_2(kv_heads),
        HEAD_DIM=dim,
        BLOCK_D=triton.next_power_of_2(dim),
        PAGE_SIZE=page_size,
        num_warps=4,
    )
