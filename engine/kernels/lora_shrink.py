"""LoRA shrink over many adapters at once: every token's x times its own adapter's A rows (Triton).

The A rows of all the step's adapters stay where they are in the pool (no gather into a dense stack):
stacked row c starts at pool row a_starts[c], a contiguous run of `in` elements, and slot u owns rows
slot_start[u] .. slot_start[u] + slot_rank[u] - 1, so adapters of different ranks share one launch with
no padding to a common rank. Two forms of the token -> adapter map:

- segments (prefill, SGMV-style): a program takes BLOCK_M tokens of one segment, loads its adapter's
  A tile once for all of them and multiplies with tl.dot;
- tokens (decode, BGMV-style): a program takes one token; a matrix-vector product per token.

Both walk `in` in BLOCK_K steps and may split it over SPLIT_K programs that add their partial sums
atomically, which gives a GPU enough programs when there are few tokens and ranks are small.
The tables and token maps come in one `LoRAKernelMeta` (lora_meta.py); the pieces both forms share are
in lora_tiles.py. Semantics, shapes and the plain-torch oracle: `reference.lora_shrink_tokens` /
`lora_shrink_segments`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dot import dot_precision, interpreting
from .gpu import gpu_target
from .lora_meta import LoRAKernelMeta
from .lora_tiles import a_row_offsets, k_range, rank_of_slot, write_shrunk

# SPLIT_K, m_blocks and the rank (stride_om, out_rank) vary from step to step: specializing on their
# values (== 1, divisible by 16) would compile a variant per value met, each stalling the step that first
# meets it. The step's metadata are views at any offset of one upload (engine/batch.py): their pointers'
# alignment varies too, and scalar loads gain nothing from it.
_STEP_METADATA = ["token_slot_ptr", "seg_starts_ptr", "seg_slot_ptr"]


@triton.jit(
    do_not_specialize=["stride_om", "out_rank", "m_blocks", "SPLIT_K"],
    do_not_specialize_on_alignment=_STEP_METADATA,
)
def _shrink_segments_kernel(
    x_ptr,
    pool_ptr,
    out_ptr,
    a_starts_ptr,
    slot_start_ptr,
    slot_rank_ptr,
    seg_starts_ptr,
    seg_slot_ptr,
    in_width,
    stride_xm,
    stride_xk,
    stride_om,
    out_rank,  # columns of out
    m_blocks,  # token blocks per segment in the grid (the longest segment's)
    SPLIT_K,  # programs per dot product; 1: out is uninitialised and every program writes its tile
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    segment = tl.program_id(0) // m_blocks
    m_block = tl.program_id(0) % m_blocks
    r_block = tl.program_id(1)
    split = tl.program_id(2)
    seg_end = tl.load(seg_starts_ptr + segment + 1)
    first = tl.load(seg_starts_ptr + segment) + m_block * BLOCK_M
    if first >= seg_end:
        return
    tokens = first + tl.arange(0, BLOCK_M)
    token_ok = tokens < seg_end
    rows = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
    out = out_ptr + tokens.to(tl.int64)[:, None] * stride_om + rows[None, :]
    mask = token_ok[:, None] & (rows < out_rank)[None, :]
    slot = tl.load(seg_slot_ptr + segment)
    rank = rank_of_slot(slot, slot_rank_ptr)
    if r_block * BLOCK_R >= rank:  # no adapter, or none of its rows here: zeros (the wrapper did not fill)
        if SPLIT_K == 1:
            tl.store(out, tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32), mask=mask)
        return
    row_ok = rows < rank
    a_base = a_row_offsets(a_starts_ptr, slot_start_ptr, slot, rows, row_ok, HEAD_DIM)  # [BLOCK_R]
    x_base = tokens.to(tl.int64) * stride_xm

    k_begin, k_end = k_range(in_width, split, SPLIT_K, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        x = tl.load(
            x_ptr + x_base[:, None] + ks[None, :] * stride_xk,
            mask=token_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        a = tl.load(pool_ptr + a_base[None, :] + ks[:, None], mask=row_ok[None, :] & k_ok[:, None], other=0.0)
        # a: [BLOCK_K, BLOCK_R]
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision=PRECISION)
        else:
            acc += tl.dot(x, a.to(x.dtype), input_precision=PRECISION)

    # Rows past the adapter's rank hold zeros (their A rows were masked to 0).
    write_shrunk(out, acc, mask, SPLIT_K)


@triton.jit(
    do_not_specialize=["stride_om", "out_rank", "SPLIT_K"], do_not_specialize_on_alignment=_STEP_METADATA
)
def _shrink_tokens_kernel(
    x_ptr,
    pool_ptr,
    out_ptr,
    a_starts_ptr,
    slot_start_ptr,
    slot_rank_ptr,
    token_slot_ptr,
    in_width,
    stride_xm,
    stride_xk,
    stride_om,
    out_rank,  # columns of out
    SPLIT_K,  # programs per dot product; 1: out is uninitialised and every program writes its tile
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0)
    r_block = tl.program_id(1)
    split = tl.program_id(2)
    rows = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
    out = out_ptr + token.to(tl.int64) * stride_om + rows
    out_ok = rows < out_rank
    slot = tl.load(token_slot_ptr + token)
    rank = rank_of_slot(slot, slot_rank_ptr)
    if r_block * BLOCK_R >= rank:  # no adapter, or none of its rows here: zeros (the wrapper did not fill)
        if SPLIT_K == 1:
            tl.store(out, tl.zeros((BLOCK_R,), dtype=tl.float32), mask=out_ok)
        return
    row_ok = rows < rank
    a_base = a_row_offsets(a_starts_ptr, slot_start_ptr, slot, rows, row_ok, HEAD_DIM)  # [BLOCK_R]
    x_base = token.to(tl.int64) * stride_xm

    k_begin, k_end = k_range(in_width, split, SPLIT_K, BLOCK_K)
    # Products are summed along K once at the end rather than reduced every step.
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        x = tl.load(x_ptr + x_base + ks * stride_xk, mask=k_ok, other=0.0)
        a = tl.load(pool_ptr + a_base[:, None] + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += a.to(tl.float32) * x.to(tl.float32)[None, :]
    write_shrunk(out, tl.sum(acc, axis=1), out_ok, SPLIT_K)


def _split_k(programs: int, k_steps: int, device: torch.device) -> int:
    """How many programs share one dot product: enough for about two waves of the GPU's SMs, while
    each still walks at least 4 BLOCK_K steps. 1 off the GPU (the interpreter gains nothing)."""
    target = gpu_target(device)
    if target is None or programs == 0:
        return 1
    return max(1, min(2 * target.sms // programs, k_steps // 4, 16))


def _output(num_tokens: int, rank: int, split: int, device: torch.device) -> torch.Tensor:
    """float32 [T, R] for the kernel's result: split programs add into zeros; one program per tile
    writes all of it (zeros where a token has no adapter), so no fill runs before it."""
    if split == 1:
        return torch.empty(num_tokens, rank, dtype=torch.float32, device=device)
    return torch.zeros(num_tokens, rank, dtype=torch.float32, device=device)


def _check(x: torch.Tensor, pool_rows: torch.Tensor) -> None:
    if not pool_rows.is_contiguous():
        raise ValueError("pool_rows must be contiguous: rows are addressed as flat offsets")
    if x.dim() != 2 or pool_rows.dim() != 2:
        raise ValueError(f"x {tuple(x.shape)} and pool_rows {tuple(pool_rows.shape)} must be 2-D")


def lora_shrink_segments(
    x: torch.Tensor, pool_rows: torch.Tensor, meta: LoRAKernelMeta, layer: int, *, split_k: int | None = None
) -> torch.Tensor:
    """Shrink for the rows of x grouped in meta's segments, with layer `layer`'s A rows. Returns float32
    [T, R], R = meta.rank() (rows of tokens outside every segment are unspecified: the engine's
    segments cover all rows).

    Shapes: x [T, in]; pool_rows [N, head_dim] contiguous; meta as in lora_meta.py, with seg_starts
    and seg_slot. split_k overrides the K split (tests; None picks one).
    """
    _check(x, pool_rows)
    rank = meta.rank()
    seg_starts, seg_slot, max_seg_len = meta.segments()
    num_tokens, in_width = x.shape
    num_segments = len(seg_slot)
    if rank == 0 or num_segments == 0 or max_seg_len == 0 or num_tokens == 0:
        return torch.zeros(num_tokens, rank, dtype=torch.float32, device=x.device)
    # Long segments reuse each A tile over more tokens; short ones waste fewer masked rows.
    block_m = 16 if max_seg_len <= 16 else 32 if max_seg_len <= 32 else 64
    block_r = min(max(triton.next_power_of_2(rank), 16), 64)
    # Tiles that compile without register spills on sm_80 and sm_90 (ptxas -v, engine/aot.py):
    # a 64-rank tile at 128 K columns spills on sm_80, and float32's exact dots want short K steps.
    if x.dtype == torch.float32:
        block_k = 16 if block_m * block_r >= 4096 else 32
    else:
        block_k = 128 if block_m * block_r <= 2048 and block_r < 64 else 64
    m_blocks = triton.cdiv(max_seg_len, block_m)
    r_blocks = triton.cdiv(rank, block_r)
    programs = num_segments * m_blocks * r_blocks
    split = split_k or _split_k(programs, triton.cdiv(in_width, block_k), x.device)
    out = _output(num_tokens, rank, split, x.device)
    _shrink_segments_kernel[(num_segments * m_blocks, r_blocks, split)](
        x,
        pool_rows,
        out,
        meta.a_starts[layer],
        meta.slot_start,
        meta.slot_rank,
        seg_starts,
        seg_slot,
        in_width,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        rank,
        m_blocks,
        split,
        HEAD_DIM=pool_rows.shape[1],
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        PRECISION=dot_precision(x.dtype),
        UPCAST=interpreting(),
    )
    return out


def lora_shrink_tokens(
    x: torch.Tensor, pool_rows: torch.Tensor, meta: LoRAKernelMeta, layer: int, *, split_k: int | None = None
) -> torch.Tensor:
    """Shrink with every row of x's adapter slot given per token (meta.token_slot), with layer
    `layer`'s A rows. Returns float32 [T, R], R = meta.rank().

    Shapes: x [T, in]; pool_rows [N, head_dim] contiguous; meta as in lora_meta.py, token_slot [T].
    """
    _check(x, pool_rows)
    rank = meta.rank()
    token_slot = meta.tokens()
    num_tokens, in_width = x.shape
    if rank == 0 or num_tokens == 0:
        return torch.zeros(num_tokens, rank, dtype=torch.float32, device=x.device)
    # A [BLOCK_R, BLOCK_K] tile of about 4096 elements whatever the rank: small ranks read longer runs.
    block_r = min(max(triton.next_power_of_2(rank), 4), 64)
    block_k = min(max(4096 // block_r, 64), 512)
    r_blocks = triton.cdiv(rank, block_r)
    split = split_k or _split_k(num_tokens * r_blocks, triton.cdiv(in_width, block_k), x.device)
    out = _output(num_tokens, rank, split, x.device)
    _shrink_tokens_kernel[(num_tokens, r_blocks, split)](
        x,
        pool_rows,
        out,
        meta.a_starts[layer],
        meta.slot_start,
        meta.slot_rank,
        token_slot,
        in_width,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        rank,
        split,
        HEAD_DIM=pool_rows.shape[1],
        BLOCK_R=block_r,
        BLOCK_K=block_k,
    )
    return out
