# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False, disallow-untyped-decorators=False
# ruff: noqa: N803 - compile-time constants are upper case, as in every Triton kernel
"""Causal attention over packed sequences of different lengths (varlen flash attention).

Prefill runs eagerly, so the grid may follow the host's max_seqlen: one program per
(query tile, sequence, query head); tiles past a sequence's end return at once.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from corelib.ops.spec import VarlenAttention
from corelib_cuda.triton_ops.common import (
    check,
    check_float,
    dot_precision,
    last_dim_contiguous,
    next_power_of_2,
    upcast_in_kernel,
)

_OP = "prefill_attention"


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, scale,
    q_s0, q_s1, k_s0, k_s1, v_s0, v_s1,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    tile, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_ptr + seq)
    length = (tl.load(cu_ptr + seq + 1) - start).to(tl.int32)
    first_row = tile * BLOCK_M
    if first_row >= length:
        return
    rows = first_row + tl.arange(0, BLOCK_M)
    d = tl.arange(0, DIM_PAD)
    d_ok = d < HEAD_DIM
    row_ok = rows < length
    token = start + rows  # int64: flat token index
    q = tl.load(q_ptr + (token * q_s0 + head * q_s1)[:, None] + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    kv_head = head // GROUP
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)  # noqa: E741 - the flash-attention name
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    # Keys up to the tile's last row: causal, so later tiles are never read.
    for first in range(0, tl.minimum(length, first_row + BLOCK_M), BLOCK_N):
        cols = first + tl.arange(0, BLOCK_N)
        col_ok = cols < length
        key = start + cols
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + (key * k_s0 + kv_head * k_s1)[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + (key * v_s0 + kv_head * v_s1)[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        # Every row sees key 0, so no row is all -inf (rows past the end are masked on store).
        s = tl.where((cols[None, :] <= rows[:, None]) & col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    heads = tl.num_programs(2)
    tl.store(out_ptr + (token * heads + head)[:, None] * HEAD_DIM + d[None, :], acc / l[:, None],
             mask=row_ok[:, None] & d_ok[None, :])


@functools.lru_cache(maxsize=16)
def _config(head_dim: int) -> tuple[int, int, int, int]:
    """(padded head dim, query tile, key tile, warps)."""
    dim_pad = next_power_of_2(head_dim)
    return (dim_pad, 64, 64, 4) if dim_pad <= 64 else (dim_pad, 64, 32, 4)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: VarlenAttention, scale: float
) -> torch.Tensor:
    # q [T, nh, hd], k / v [T, nkv, hd] (may be strided views), cu_seqlens [n+1] -> [T, nh, hd]
    check_float(_OP, q=q, k=k, v=v)
    check(q.dim() == 3 and k.dim() == 3 and k.shape == v.shape, _OP,
          f"expected q [T, nh, hd], k and v [T, nkv, hd]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    check(k.shape[0] == tokens and k.shape[2] == head_dim and heads % kv_heads == 0, _OP,
          f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree (same T and hd, nh % nkv == 0)")
    check(q.dtype == k.dtype == v.dtype, _OP, "q, k and v need one dtype")
    cu_seqlens = attn.cu_seqlens
    check(cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 1, _OP, "cu_seqlens must be [n+1] sequence starts")
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    num_seqs = cu_seqlens.numel() - 1
    if tokens == 0 or num_seqs == 0 or attn.max_seqlen <= 0:
        return out
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    dim_pad, block_m, block_n, warps = _config(head_dim)
    grid = (triton.cdiv(attn.max_seqlen, block_m), num_seqs, heads)
    _prefill_kernel[grid](
        q, k, v, out, cu_seqlens, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=upcast_in_kernel(), PRECISION=dot_precision(q.dtype), num_warps=warps,
    )  # fmt: skip
    return out
