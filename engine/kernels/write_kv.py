"""Store one layer's new keys and values in their pool slots, in Triton; optionally rotating q and k.

`write_kv` has the signature and semantics of `reference.write_kv`: one program per new token copies
its [kv_heads, head_dim] keys and values into page slots[t] // page_size at offset slots[t] % page_size.
`rotary_write_kv` (`reference.rotary_write_kv`) also applies the rotary embedding to q and k first, in
one launch: on the kernel path the model hands attention unrotated q and k, and the keys are rotated on
their way into the pool instead of by five separate torch kernels and a copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .row_tiles import rows_per_program


@triton.jit(do_not_specialize=["layer"])  # every layer shares one compiled variant
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


@triton.jit
def _rotate_rows(
    row_ptr,  # [ROWS] pointers to the rows' first elements
    token,  # [ROWS] each row's token
    valid,  # [ROWS]
    cos_ptr,
    sin_ptr,
    stride_cos,
    stride_sin,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Rotate [ROWS, head_dim] rows in place (rotate-half) and return them."""
    d = tl.arange(0, BLOCK_D)
    half = HEAD_DIM // 2
    first_half = (d < half)[None, :]
    partner = tl.where(d < half, d + half, d - half)
    mask = valid[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(row_ptr[:, None] + d[None, :], mask=mask, other=0.0)
    # Negated in float32: exact, and the interpreter holds bfloat16 as raw 16-bit integers.
    x_partner = tl.load(row_ptr[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    rotated = tl.where(first_half, -x_partner, x_partner)
    cos = tl.load(cos_ptr + token[:, None] * stride_cos + d[None, :], mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token[:, None] * stride_sin + d[None, :], mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin with each product and the sum rounded to the dtype, as in torch.
    dtype = x.dtype
    out = ((x.to(tl.float32) * cos).to(dtype).to(tl.float32) + (rotated * sin).to(dtype).to(tl.float32)).to(
        dtype
    )
    tl.store(row_ptr[:, None] + d[None, :], out, mask=mask)
    return out


@triton.jit(do_not_specialize=["layer", "num_tokens"])
def _rotary_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,
    memory_ptr,
    layer,
    num_tokens,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_sin,
    stride_page,
    stride_layer,
    stride_part,
    stride_head,
    stride_off,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
):
    # Rows are (token, head) pairs, q's first then k's: a head's rotate-half partner lies in its own
    # row, so rows rotate in place independently. The first programs take q rows, the rest k rows.
    q_programs = tl.cdiv(num_tokens * HEADS, ROWS)
    pid = tl.program_id(0)
    r = tl.arange(0, ROWS)
    if pid < q_programs:
        rows = pid * ROWS + r
        token = (rows // HEADS).to(tl.int64)
        row_ptr = q_ptr + token * stride_qt + (rows % HEADS) * stride_qh
        _rotate_rows(
            row_ptr,
            token,
            rows < num_tokens * HEADS,
            cos_ptr,
            sin_ptr,
            stride_cos,
            stride_sin,
            HEAD_DIM,
            BLOCK_D,
        )
    else:
        rows = (pid - q_programs) * ROWS + r
        valid = rows < num_tokens * KV_HEADS
        token = (rows // KV_HEADS).to(tl.int64)
        head = rows % KV_HEADS
        row_ptr = k_ptr + token * stride_kt + head * stride_kh
        key = _rotate_rows(row_ptr, token, valid, cos_ptr, sin_ptr, stride_cos, stride_sin, HEAD_DIM, BLOCK_D)
        d = tl.arange(0, BLOCK_D)
        mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        slot = tl.load(slots_ptr + token, mask=valid, other=0).to(tl.int64)
        base = (slot // PAGE_SIZE) * stride_page + layer * stride_layer + (slot % PAGE_SIZE) * stride_off
        dst = memory_ptr + (base + head * stride_head)[:, None] + d[None, :]
        value = tl.load(v_ptr + (token * stride_vt + head * stride_vh)[:, None] + d[None, :], mask=mask)
        tl.store(dst, key.to(memory_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_part, value.to(memory_ptr.dtype.element_ty), mask=mask)


def rotary_write_kv(
    memory: torch.Tensor,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rows_each: int | None = None,
) -> None:
    """Rotate q and k in place and store k and v of one layer in their slots, in one launch.

    Shapes: memory as `write_kv`; q [T, heads, head_dim], k, v [T, kv_heads, head_dim] (views of the
    qkv projection are fine: head_dim must be contiguous); slots [T] int64; cos, sin [T, 1, head_dim] or
    [T, head_dim], the tokens' rows of the model's tables, in q's dtype.
    Semantics: q = rope(q), k = rope(k) with rope(x) = x * cos + rotate_half(x) * sin; then
    write_kv(memory, layer, k, v, slots).
    `rows_each`: (token, head) rows per program, a power of two (default: row_tiles.rows_per_program).
    """
    num_tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    assert memory.is_contiguous(), "the pool must be contiguous"
    assert k.shape == v.shape == (num_tokens, kv_heads, dim), "k and v must be [T, kv_heads, head_dim]"
    assert q.dtype == k.dtype == cos.dtype == sin.dtype, "q, k, cos and sin must share a dtype"
    assert dim % 2 == 0, "rotate-half needs an even head_dim"
    cos2, sin2 = cos.reshape(num_tokens, dim), sin.reshape(num_tokens, dim)
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos2), ("sin", sin2)):
        assert t.stride(-1) == 1, f"head_dim must be the contiguous axis of {name}"
    if num_tokens == 0:
        return
    rows_each = rows_each or rows_per_program(q.device, num_tokens * heads, dim, gpu_rows=4)
    programs = triton.cdiv(num_tokens * heads, rows_each) + triton.cdiv(num_tokens * kv_heads, rows_each)
    _rotary_write_kv_kernel[(programs,)](
        q,
        k,
        v,
        cos2,
        sin2,
        slots,
        memory,
        layer,
        num_tokens,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos2.stride(0),
        sin2.stride(0),
        *memory.stride()[:5],
        HEADS=heads,
        KV_HEADS=kv_heads,
        HEAD_DIM=dim,
        BLOCK_D=triton.next_power_of_2(dim),
        PAGE_SIZE=memory.shape[4],
        ROWS=rows_each,
        num_warps=2,  # 4 rows of 64-128 elements on a GPU
    )
