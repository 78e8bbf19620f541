# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False, disallow-untyped-decorators=False
# ruff: noqa: N803 - compile-time constants are upper case, as in every Triton kernel
"""RoPE on q and k with the paged KV write: one kernel per step reads qk and v once."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from corelib_cuda.triton_ops.common import check, check_float, interpreting, last_dim_contiguous, next_power_of_2
from corelib_cuda.triton_ops.norm import check_rows, row_chunk, row_rstd
from corelib_cuda.triton_ops.rounding import rounded

_OP = "rope_kv_write"


@triton.jit
def unnormed(x, rstd, bias_ptr, cols, ok, DTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, RNE: tl.constexpr):
    """A product of the rows before their norm (its weight folded into the projection's) as the projection of the
    normalized rows gives it: times the row's 1/rms, plus the bias, rounded to the model dtype."""
    x = x * rstd
    if HAS_BIAS:
        x += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    return rounded(x, DTYPE, RNE).to(tl.float32)


@triton.jit
def rotated_heads(row_ptr, head, d, partner, mask, rstd, bias_ptr, cos, sin, HEAD_DIM: tl.constexpr,
                  DTYPE: tl.constexpr, NORM_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, RNE: tl.constexpr):
    """Heads ``head`` [R] of one row of the qkv product, rotated [R, DIM_PAD] in DTYPE, rounded as the kernel below
    rounds them: x * cos + rotate_half(x) * sin (``sin`` carries rotate_half's sign; ``partner``: d's other half).
    For a kernel that rotates one head's whole width at once (the decode attention's); this one rotates halves."""
    cols = head[:, None] * HEAD_DIM + d[None, :]
    partner_cols = head[:, None] * HEAD_DIM + partner[None, :]
    x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row_ptr + partner_cols, mask=mask, other=0.0).to(tl.float32)
    if NORM_ROWS:
        x = unnormed(x, rstd, bias_ptr, cols, mask, DTYPE, HAS_BIAS, RNE)
        xp = unnormed(xp, rstd, bias_ptr, partner_cols, mask, DTYPE, HAS_BIAS, RNE)
    out = rounded(x * cos, DTYPE, RNE) + rounded(xp * sin, DTYPE, RNE)
    return rounded(out, DTYPE, RNE).to(DTYPE)


@triton.jit
def rope_angles(cs_ptr, position, cs_s0, cs_s1, d, d_ok, HALF: tl.constexpr):
    """cos and sin [1, DIM_PAD] of ``position``, sin with rotate_half's sign, and each d's other half."""
    angles = cs_ptr + position * cs_s0 + d
    cos = tl.load(angles, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin = (tl.load(angles + cs_s1, mask=d_ok, other=0.0).to(tl.float32) * tl.where(d < HALF, -1.0, 1.0))[None, :]
    return cos, sin, tl.where(d < HALF, d + HALF, d - HALF)


@triton.jit
def _rope_kv_write_kernel(
    qk_ptr, v_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr, out_ptr, h_ptr, bias_ptr,
    qk_s0, qk_s1, v_s0, v_s1, cs_s0, cs_s1,
    kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh,
    block_size, h_s0, hidden, eps,
    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr, RNE: tl.constexpr,
    NORM_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, ROW_CHUNK: tl.constexpr,
):  # fmt: skip
    # One program per token: every q and k head rotated, k and v written to the token's slot. With NORM_ROWS,
    # qk and v are the product of the rows of h before their norm (its weight folded into the projection's):
    # each is scaled by its row's 1/rms and given the bias here first.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    heads = tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    mask = (heads < NUM_Q + NUM_KV)[:, None] & d_ok[None, :]
    src = qk_ptr + t * qk_s0 + heads[:, None] * qk_s1 + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if NORM_ROWS:
        rstd = row_rstd(h_ptr + t * h_s0, hidden, eps, ROW_CHUNK)
        features = heads[:, None] * (2 * HALF) + d[None, :]  # the bias's columns (q and k: the first rows)
        x1 = unnormed(x1, rstd, bias_ptr, features, mask, dtype, HAS_BIAS, RNE)
        x2 = unnormed(x2, rstd, bias_ptr, features + HALF, mask, dtype, HAS_BIAS, RNE)
    cos = cs_ptr + pos * cs_s0 + d
    c1 = tl.load(cos, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos + HALF, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(cos + cs_s1, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(cos + cs_s1 + HALF, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    # x * cos + rotate_half(x) * sin with each product rounded to the model dtype, as the
    # reference computes it in that dtype.
    o1 = rounded(x1 * c1, dtype, RNE) + rounded(-x2 * s1, dtype, RNE)
    o2 = rounded(x2 * c2, dtype, RNE) + rounded(x1 * s2, dtype, RNE)
    o1, o2 = rounded(o1, dtype, RNE).to(dtype), rounded(o2, dtype, RNE).to(dtype)
    dst = out_ptr + t * ((NUM_Q + NUM_KV) * 2 * HALF) + heads[:, None] * (2 * HALF) + d[None, :]
    tl.store(dst, o1, mask=mask)
    tl.store(dst + HALF, o2, mask=mask)

    slot = tl.load(slot_ptr + t)
    block, offset = slot // block_size, slot % block_size
    # Rows NUM_Q.. of the rotated tile are the keys; a negative slot (padding) writes nothing.
    # (the slot test is broadcast to a tensor first: the interpreter cannot mask with a scalar)
    writes = (heads >= NUM_Q) & (slot + heads * 0 >= 0)
    k_mask = mask & writes[:, None]
    k_dst = kc_ptr + block * kc_sb + offset * kc_st + (heads - NUM_Q)[:, None] * kc_sh + d[None, :]
    tl.store(k_dst, o1, mask=k_mask)
    tl.store(k_dst + HALF, o2, mask=k_mask)

    kv = tl.arange(0, BLOCK_KV)
    full = tl.arange(0, 2 * BLOCK_HALF)
    v_mask = ((kv < NUM_KV) & (slot + kv * 0 >= 0))[:, None] & (full < 2 * HALF)[None, :]
    v = tl.load(v_ptr + t * v_s0 + kv[:, None] * v_s1 + full[None, :], mask=v_mask, other=0.0)
    if NORM_ROWS:
        v_cols = (NUM_Q + NUM_KV + kv)[:, None] * (2 * HALF) + full[None, :]
        v = unnormed(v.to(tl.float32), rstd, bias_ptr, v_cols, v_mask, dtype, HAS_BIAS, RNE).to(dtype)
    v_dst = vc_ptr + block * vc_sb + offset * vc_st + kv[:, None] * vc_sh + full[None, :]
    tl.store(v_dst, v, mask=v_mask)


@functools.lru_cache(maxsize=64)
def _config(heads: int, kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """(padded heads, padded KV heads, padded half head dim, warps)."""
    block_heads, block_half = next_power_of_2(heads), next_power_of_2(head_dim // 2)
    warps = 4 if block_heads * block_half <= 2048 else 8
    return block_heads, next_power_of_2(kv_heads), block_half, warps


def rope_kv_write(
    qk: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    eps: float = 0.0,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """qk [T, nh+nkv, hd], v [T, nkv, hd] (views of one qkv output), positions [T], cos_sin [L, 2, hd],
    k_cache / v_cache [NB, bs, nkv, hd], slot_mapping [T] -> rotated qk [T, nh+nkv, hd].

    With ``rows`` [T, H] (h, whose norm's weight is folded into the projection that gave qk and v from h
    itself), qk and v are first scaled by each row's 1/rms and given ``bias`` [(nh + 2 nkv) hd] (the
    projection's, left out of its product): the norm's kernel is not needed."""
    check_float(_OP, qk=qk, v=v, cos_sin=cos_sin)
    check(qk.dim() == 3 and v.dim() == 3 and k_cache.dim() == 4, _OP,
          f"expected qk [T, nh+nkv, hd], v [T, nkv, hd], caches [NB, bs, nkv, hd]; got qk {tuple(qk.shape)}, "
          f"v {tuple(v.shape)}, k_cache {tuple(k_cache.shape)}")
    tokens, heads, head_dim = qk.shape
    kv_heads = v.shape[1]
    check(v.shape == (tokens, kv_heads, head_dim) and 0 < kv_heads < heads and head_dim % 2 == 0, _OP,
          f"v {tuple(v.shape)} does not match qk {tuple(qk.shape)} (hd even, fewer KV heads than q+k heads)")
    check(k_cache.shape == v_cache.shape and k_cache.shape[2:] == (kv_heads, head_dim), _OP,
          f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}; expected [NB, bs, {kv_heads}, {head_dim}]")
    check(k_cache.dtype == qk.dtype == v.dtype == v_cache.dtype, _OP, "qk, v and the caches need one dtype")
    check(cos_sin.dim() == 3 and cos_sin.shape[1:] == (2, head_dim), _OP,
          f"cos_sin {tuple(cos_sin.shape)}; expected [max_len, 2, {head_dim}]")
    check(positions.shape == (tokens,) and slot_mapping.shape == (tokens,), _OP,
          f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)}; expected ({tokens},)")
    check(k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, _OP, "the caches need a contiguous last dim")
    out = torch.empty((tokens, heads, head_dim), dtype=qk.dtype, device=qk.device)
    if tokens == 0:
        return out
    qk, v, cos_sin = last_dim_contiguous(qk), last_dim_contiguous(v), last_dim_contiguous(cos_sin)
    if rows is not None:
        check_rows(_OP, rows, tokens, qk.dtype)
        check(bias is None or bias.shape == ((heads + kv_heads) * head_dim,), _OP,
              f"bias {None if bias is None else tuple(bias.shape)}; expected ({(heads + kv_heads) * head_dim},)")
    block_heads, block_kv, block_half, warps = _config(heads, kv_heads, head_dim)
    hidden = 1 if rows is None else rows.shape[1]
    _rope_kv_write_kernel[(tokens,)](
        qk, v, positions, cos_sin, k_cache, v_cache, slot_mapping, out,
        qk if rows is None else rows, qk if bias is None else bias,
        qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), cos_sin.stride(0), cos_sin.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_cache.shape[1], 0 if rows is None else rows.stride(0), hidden, eps,
        NUM_Q=heads - kv_heads, NUM_KV=kv_heads, HALF=head_dim // 2,
        BLOCK_HEADS=block_heads, BLOCK_KV=block_kv, BLOCK_HALF=block_half, RNE=interpreting(),
        NORM_ROWS=rows is not None, HAS_BIAS=bias is not None and rows is not None,
        ROW_CHUNK=row_chunk(hidden), num_warps=warps,
    )  # fmt: skip
    return out
