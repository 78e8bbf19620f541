# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False, disallow-untyped-decorators=False
# ruff: noqa: N803 - compile-time constants are upper case, as in every Triton kernel
"""Paged decode attention (flash-decoding): each KV head's query group together, split over the context.

One program per (sequence, KV head, split) reads that split's live keys once for all the query
heads of its group. The number of splits comes from static sizes only (batch rows, KV heads,
block-table width), so the grid is fixed for a captured graph; each program finds its share of
the live context from seq_lens on the device. With one split the first kernel writes the output
itself; with more, a second kernel merges the partial results by their log-sum-exp.

With ``rope`` the kernel starts from the qkv projection's product instead of rotated queries
(``ROPE``): each program rotates its query group and its KV head's new key itself (scaled by the
row's 1/rms first where the norm's weight is folded into the projection), as the RoPE kernel
rounds them, and the split that holds the newest position writes the new key and value into the
cache and attends to them from registers. Beside a library GEMM this takes the RoPE kernel out of
the decoder layer.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from corelib.ops.spec import PagedAttention
from corelib_cuda.triton_ops.common import (
    check,
    check_float,
    dot_precision,
    interpreting,
    last_dim_contiguous,
    next_power_of_2,
    sm_count,
    upcast_in_kernel,
)
from corelib_cuda.triton_ops.norm import row_chunk, row_rstd
from corelib_cuda.triton_ops.rope import rope_angles, rotated_heads, unnormed

_OP = "paged_attention"  # its decode steps: one query per row
#: the most splits of one sequence's context; also the partial buffers' static size
MAX_SPLITS = 32
#: fewer keys than this per split cost more in merging than they gain in parallelism
MIN_SPLIT_KEYS = 64
#: a span of at most SHORT_SPAN keys (the default decode graph's width) is not split where the grid already has
#: UNSPLIT_PROGRAMS_PER_SM programs a multiprocessor: there the merge kernel costs more than the parallelism gains
SHORT_SPAN = 256
UNSPLIT_PROGRAMS_PER_SM = 2
#: a split of one key tile reads the keys and values of earlier steps before the PDL wait, and only the
#: step's own (the newest position, which the kernel before writes) after it
EARLY_KV = False


@triton.jit
def load_kv_tile(kc_ptr, vc_ptr, table, pos, live, d, d_ok, kv_head, block_size,
                 kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, UPCAST: tl.constexpr):
    """The keys and values [BLOCK_N, DIM_PAD] of positions ``pos`` of one sequence, read through its block
    table (``live``: the positions that exist; others read as 0)."""
    block = tl.load(table + pos // block_size, mask=live, other=0).to(tl.int64)
    return load_kv_blocks(kc_ptr, vc_ptr, block, pos, live, d, d_ok, kv_head, block_size,
                          kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, UPCAST)


@triton.jit
def load_kv_blocks(kc_ptr, vc_ptr, block, pos, live, d, d_ok, kv_head, block_size,
                   kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, UPCAST: tl.constexpr):
    """:func:`load_kv_tile` with the positions' cache blocks already read (int64)."""
    offset = pos % block_size
    kv_mask = live[:, None] & d_ok[None, :]
    k = tl.load(kc_ptr + (block * kc_sb + offset * kc_st + kv_head * kc_sh)[:, None] + d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(vc_ptr + (block * vc_sb + offset * vc_st + kv_head * vc_sh)[:, None] + d[None, :],
                mask=kv_mask, other=0.0)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    return k, v


@triton.jit
def attend_tile(q, k, v, visible, m, l, acc, scale, PRECISION: tl.constexpr):  # noqa: E741
    """One key tile into the online softmax: the running maximum ``m``, sum ``l`` and output ``acc`` of each
    query row; ``visible`` [rows, BLOCK_N] (or [1, BLOCK_N] for every row) says which keys a row sees."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [rows, BLOCK_N]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc


@triton.jit
def _attend_one(q, k, v, m, l, acc, scale):  # noqa: E741
    """One key [1, DIM_PAD] (and its value) into the online softmax of every query row, as ``attend_tile`` takes a
    tile: the newest key, held in registers."""
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32), axis=1) * scale  # [rows]
    m_new = tl.maximum(m, s)
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new)
    acc = acc * alpha[:, None] + p.to(v.dtype).to(tl.float32)[:, None] * v.to(tl.float32)
    return m_new, l * alpha + p, acc


@triton.jit
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, sl_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    scale, block_size,
    q_s0, q_s1, kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, bt_s0,
    h_ptr, h_s0, hidden, eps, bias_ptr, pos_ptr, cs_ptr, cs_s0, cs_s1, slot_ptr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, ONE_TILE: tl.constexpr, EARLY_KV: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
    ROPE: tl.constexpr, NORM_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, ROW_CHUNK: tl.constexpr, RNE: tl.constexpr,
):  # fmt: skip
    # ROPE: q_ptr is the qkv product [B, (nh + 2 nkv) hd] (q_s0 its row stride), rotated here; the new key and
    # value go to the cache at slot_ptr[seq] (negative: not written) from the split that holds position
    # seq_len - 1, which attends to them from registers. NORM_ROWS: the product is of h's rows before their norm
    # (h_ptr, its weight folded into the projection): scaled by the row's 1/rms and given the bias first.
    if PDL:  # launched early: the next kernel may launch too
        tl.extra.cuda.gdc_launch_dependents()
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # The lengths and block tables are the step's inputs, written before the step began (no kernel of
    # the step writes them): read before the PDL wait, as the projections read their weights; the
    # queries and the caches, which the kernels before this one write, after it.
    seq_len = tl.load(sl_ptr + seq).to(tl.int32)
    # Splits take whole BLOCK_N tiles, so a short context leaves the last splits empty.
    per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    table = bt_ptr + seq * bt_s0
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    g_ok, d_ok = g < GROUP, d < HEAD_DIM
    if ONE_TILE:  # no split holds more than one tile: its cache blocks too
        pos = start + tl.arange(0, BLOCK_N)
        live = pos < end
        blocks = tl.load(table + pos // block_size, mask=live, other=0).to(tl.int64)
        if EARLY_KV:  # and the keys of earlier steps: only the newest is this step's
            newest = pos == seq_len - 1
            older = live & (pos != seq_len - 1)
            k, v = load_kv_blocks(kc_ptr, vc_ptr, blocks, pos, older, d, d_ok, kv_head, block_size,
                                  kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, UPCAST)
    if PDL:
        tl.extra.cuda.gdc_wait()

    heads = kv_head * GROUP + g  # the query heads that read this KV head
    q_mask = g_ok[:, None] & d_ok[None, :]
    key_end = end
    if ROPE:
        dtype = kc_ptr.dtype.element_ty
        rstd = 1.0
        if NORM_ROWS:
            rstd = row_rstd(h_ptr + seq * h_s0, hidden, eps, ROW_CHUNK)
        position = tl.load(pos_ptr + seq)
        cos, sin, partner = rope_angles(cs_ptr, position, cs_s0, cs_s1, d, d_ok, HEAD_DIM // 2)
        q = rotated_heads(q_ptr + seq * q_s0, heads, d, partner, q_mask, rstd, bias_ptr, cos, sin, HEAD_DIM, dtype,
                     NORM_ROWS, HAS_BIAS, RNE)
        # The split that holds the newest position writes the step's key and value there, after its pass over the
        # cache, and attends to them from registers: the pass leaves that position out (a padded row's, whose slot
        # is negative, is not written: the pass reads the cache there, as the attention after the RoPE kernel does).
        slot = tl.load(slot_ptr + seq)
        newest_here = (start <= seq_len - 1) & (seq_len - 1 < end) & (slot >= 0)
        key_end = tl.where(newest_here, seq_len - 1, end)
    else:
        q = tl.load(q_ptr + seq * q_s0 + heads[:, None] * q_s1 + d[None, :], mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)  # noqa: E741 - the flash-attention name
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    if ONE_TILE:
        live = pos < key_end
        if start < key_end:
            if EARLY_KV:  # the newest key and value, in the split that holds them
                k_new, v_new = load_kv_blocks(kc_ptr, vc_ptr, blocks, pos, live & newest, d, d_ok, kv_head,
                                              block_size, kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, UPCAST)
                k = tl.where(newest[:, None], k_new, k)
                v = tl.where(newest[:, None], v_new, v)
            else:
                k, v = load_kv_blocks(kc_ptr, vc_ptr, blocks, pos, live, d, d_ok, kv_head, block_size,
                                      kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, UPCAST)
            m, l, acc = attend_tile(q, k, v, live[None, :], m, l, acc, scale, PRECISION)  # noqa: E741
    else:
        for first in range(start, key_end, BLOCK_N):
            pos = first + tl.arange(0, BLOCK_N)
            live = pos < key_end
            k, v = load_kv_tile(kc_ptr, vc_ptr, table, pos, live, d, d_ok, kv_head, block_size,
                                kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, UPCAST)
            m, l, acc = attend_tile(q, k, v, live[None, :], m, l, acc, scale, PRECISION)  # noqa: E741
    if ROPE:  # noqa: SIM102 - a compile-time branch around a run-time one
        if newest_here:  # the step's key and value: rotated, written, attended to
            # (the angles read again rather than held in registers across the pass over the cache)
            cos, sin, partner = rope_angles(cs_ptr, position, cs_s0, cs_s1, d, d_ok, HEAD_DIM // 2)
            row = q_ptr + seq * q_s0
            one = tl.zeros([1], tl.int32)
            new_mask = (one == 0)[:, None] & d_ok[None, :]
            num_q = tl.num_programs(1) * GROUP
            key = rotated_heads(row, num_q + kv_head + one, d, partner, new_mask, rstd, bias_ptr, cos, sin, HEAD_DIM,
                           dtype, NORM_ROWS, HAS_BIAS, RNE)  # [1, DIM_PAD]
            v_cols = (num_q + tl.num_programs(1) + kv_head + one)[:, None] * HEAD_DIM + d[None, :]
            value = tl.load(row + v_cols, mask=new_mask, other=0.0)
            if NORM_ROWS:
                value = unnormed(value.to(tl.float32), rstd, bias_ptr, v_cols, new_mask, dtype, HAS_BIAS,
                                 RNE).to(dtype)
            block, offset = slot // block_size, slot % block_size
            tl.store(kc_ptr + block * kc_sb + offset * kc_st + kv_head * kc_sh + d[None, :], key, mask=new_mask)
            tl.store(vc_ptr + block * vc_sb + offset * vc_st + kv_head * vc_sh + d[None, :], value, mask=new_mask)
            m, l, acc = _attend_one(q, key, value, m, l, acc, scale)  # noqa: E741

    out_mask = g_ok[:, None] & d_ok[None, :]
    out_row = seq * (GROUP * tl.num_programs(1)) + heads  # a row of the output [B * nh, hd]
    if SPLITS == 1:
        tl.store(out_ptr + out_row[:, None] * HEAD_DIM + d[None, :], acc / l[:, None], mask=out_mask)
    else:
        # Partials [B, nh, SPLITS, (hd | 1)]; an empty split has l = 0: lse -inf, weight 0 in the merge.
        empty = l == 0.0
        lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, l)))
        part = acc / tl.where(empty, 1.0, l)[:, None]
        row = out_row * SPLITS + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], part, mask=out_mask)
        tl.store(part_lse_ptr + row, lse, mask=g_ok)


@triton.jit
def merge_partials(part_out_ptr, part_lse_ptr, out_ptr, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  DIM_PAD: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)  # one (sequence, query head)
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, DIM_PAD)
    lse = tl.load(part_lse_ptr + row * SPLITS + sp)
    weight = tl.exp(lse - tl.max(lse, axis=0))  # split 0 always holds a key: the max is finite
    part = tl.load(part_out_ptr + (row * SPLITS + sp)[:, None] * HEAD_DIM + d[None, :],
                   mask=(d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(part * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptr + row * HEAD_DIM + d, out, mask=d < HEAD_DIM)


class DecodeConfig(NamedTuple):
    splits: int  # programs per (sequence, KV head), each over a share of the context
    group_pad: int  # query heads per KV head, padded for tl.dot
    dim_pad: int
    block_n: int  # keys per tile
    warps: int
    stages: int
    one_tile: bool  # no split holds more than one key tile: the kernel reads its blocks before the PDL wait


@functools.lru_cache(maxsize=256)
def decode_config(batch: int, kv_heads: int, group: int, head_dim: int, span: int, sms: int) -> DecodeConfig:
    """The launch of one shape, from static sizes only (span = W * bs, the widest possible context).

    Splits fill about four programs per multiprocessor at heads of 64 or less, two at wider heads,
    and keep at least MIN_SPLIT_KEYS keys of the span each; a power of two, for the merge kernel.
    A key tile of a 64-wide head is half the bytes of a 128-wide one, so it takes twice the
    programs to keep as many loads in flight. Measured on an H200 (µs per layer, 16 query and 8 KV
    heads, graph-replayed), heads of 64, four against two: bs 32 at 1,900 tokens 38.8 against 53.6
    (3.2 against 2.3 TB/s of KV), bs 64 67.9 against 95.7, bs 8 11.5 against 17.0, bs 1 and 128
    the same; at heads of 128 four per multiprocessor was 3-18 % slower.

    A span of at most SHORT_SPAN keys takes one split where the grid has UNSPLIT_PROGRAMS_PER_SM programs a
    multiprocessor without splitting: small-0.6b at bs 64 (512 programs) in its 256-token decode graph took a TPOT
    of 1.273 ms against 1.294-1.297 with two splits and the merge kernel (H100, two alternations), one kernel
    fewer a layer. At bs 32 (256 programs) one split measured the same, at bs 1 and 8 slower (H200), so
    those keep their splits (BENCHMARKS.md, 2026-12-05 and 2026-12-07, evening).
    """
    programs = batch * kv_heads
    per_sm = 4 if head_dim <= 64 else 2
    wanted = min(triton.cdiv(per_sm * sms, programs), triton.cdiv(span, MIN_SPLIT_KEYS), MAX_SPLITS)
    if span <= SHORT_SPAN and programs >= UNSPLIT_PROGRAMS_PER_SM * sms:
        wanted = 1
    splits = 1 if wanted <= 1 else min(next_power_of_2(wanted), MAX_SPLITS)
    group_pad = max(16, next_power_of_2(group))  # tl.dot takes at least 16 rows
    # 64-key tiles, 4 warps, 2 stages: the best or within 3 % of it over bs 1-128, context 96-1900,
    # head dims 64 and 128 on an H200 (4.1 TB/s of KV read at bs 128, context 1900).
    block_n = 64
    return DecodeConfig(splits, group_pad, next_power_of_2(head_dim), block_n, warps=4, stages=2,
                        one_tile=triton.cdiv(span, splits) <= block_n)


class Rope(NamedTuple):
    """What the kernel needs to start from the qkv projection's product: RoPE's and the KV write's inputs."""

    positions: torch.Tensor  # [B] int64
    cos_sin: torch.Tensor  # [max_len, 2, hd]
    slot_mapping: torch.Tensor  # [B] int64 (negative: not written)
    rows: torch.Tensor | None = None  # h [B, H], whose norm's weight is folded into the projection: scale by 1/rms
    eps: float = 0.0
    bias: torch.Tensor | None = None  # [(nh + 2 nkv) hd], added after the scale (with ``rows`` only)


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: PagedAttention, scale: float, *,
    pdl: bool = False, rope: Rope | None = None,
) -> torch.Tensor:
    # q [B, nh, hd], k_cache / v_cache [NB, bs, nkv, hd], block_tables [B, W], seq_lens [B] -> [B, nh, hd]
    # pdl: both kernels launched with programmatic dependent launch (each waits for its predecessor first)
    # rope: q is the qkv product [B, (nh + 2 nkv) hd], rotated in the kernel, its keys and values written to the cache
    product = q
    if rope is not None:
        check(q.dim() == 2 and q.stride(-1) == 1 and k_cache.dim() == 4, _OP,
              f"with rope, q is the qkv product [B, (nh + 2 nkv) hd]; got {tuple(q.shape)}")
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        check(q.shape[1] % head_dim == 0 and q.shape[1] // head_dim > 2 * kv_heads and head_dim % 2 == 0, _OP,
              f"the qkv product has {q.shape[1]} columns; expected (nh + 2 * {kv_heads}) * {head_dim}")
        q = q.view(q.shape[0], q.shape[1] // head_dim, head_dim)[:, : q.shape[1] // head_dim - 2 * kv_heads]
    check_float(_OP, q=q, k_cache=k_cache)
    check(q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape, _OP,
          f"expected q [B, nh, hd] and caches [NB, bs, nkv, hd]; got q {tuple(q.shape)}, "
          f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    batch, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    check(k_cache.shape[3] == head_dim and heads % kv_heads == 0, _OP,
          f"q has {heads} heads of {head_dim}; the caches {kv_heads} of {k_cache.shape[3]} (nh % nkv == 0)")
    check(q.dtype == k_cache.dtype == v_cache.dtype, _OP, "q and the caches need one dtype")
    tables, seq_lens = attn.block_tables, attn.seq_lens
    check(tables.dim() == 2 and tables.shape[0] == batch and seq_lens.shape == (batch,), _OP,
          f"block_tables {tuple(tables.shape)} and seq_lens {tuple(seq_lens.shape)} do not match {batch} rows")
    check(block_size == attn.block_size, _OP, f"the caches hold blocks of {block_size}, attn says {attn.block_size}")
    check(k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and tables.stride(-1) == 1, _OP,
          "the caches and block_tables need a contiguous last dim")
    out = torch.empty((batch, heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    hidden = 1
    if rope is None:
        q = last_dim_contiguous(q)
        extra: list[object] = [q, 0, hidden, 0.0, q, q, q, 0, 0, q]  # unused without ROPE
    else:
        positions, cos_sin, slots, rows, eps, bias = rope  # checked by the caller (norm_qkv_attention)
        hidden = 1 if rows is None else rows.shape[1]
        extra = [product if rows is None else rows, 0 if rows is None else rows.stride(0), hidden, eps,
                 product if bias is None else bias, positions, cos_sin, cos_sin.stride(0), cos_sin.stride(1), slots]
        q = product
    group = heads // kv_heads
    config = decode_config(batch, kv_heads, group, head_dim, tables.shape[1] * block_size, sm_count(q.device))
    splits = config.splits
    launch = {"launch_pdl": True} if pdl else {}
    if splits > 1:
        part_out = torch.empty((batch, heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused: the kernel writes the output itself
    _decode_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, tables, seq_lens, out, part_out, part_lse,
        scale, block_size,
        q.stride(0), q.stride(1) if rope is None else head_dim, k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), tables.stride(0), *extra,
        GROUP=group, GROUP_PAD=config.group_pad, HEAD_DIM=head_dim, DIM_PAD=config.dim_pad, BLOCK_N=config.block_n,
        SPLITS=splits, ONE_TILE=config.one_tile, EARLY_KV=config.one_tile and EARLY_KV and rope is None,
        UPCAST=upcast_in_kernel(), PRECISION=dot_precision(q.dtype), PDL=pdl, ROPE=rope is not None,
        NORM_ROWS=rope is not None and rope.rows is not None, HAS_BIAS=rope is not None and rope.bias is not None,
        ROW_CHUNK=row_chunk(hidden), RNE=interpreting(),
        num_warps=config.warps, num_stages=config.stages, **launch,
    )  # fmt: skip
    if splits > 1:
        merge_partials[(batch * heads,)](part_out, part_lse, out, SPLITS=splits, HEAD_DIM=head_dim,
                                        DIM_PAD=config.dim_pad, PDL=pdl, **launch)
    return out
