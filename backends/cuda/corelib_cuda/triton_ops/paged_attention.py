# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False, disallow-untyped-decorators=False
# ruff: noqa: N803 - compile-time constants are upper case, as in every Triton kernel
"""Paged attention for query lengths of 1 or more: a step's prefill chunks and decode rows together.

A decode step (one query per row) is the flash-decoding kernel of ``decode_attention``, as it
always was: graph-safe, split over the context. A step with longer rows run eagerly has a grid
that follows the host's longest query count: one program per (query tile, row, query head)
reads that row's cached keys through its block table, up to the tile's last query position
(causal: a query at position p sees keys 0..p, the chunk's own keys already written), with an
online softmax. Tiles past a row's queries return at once.

A captured step (``attn.captured``: the graph of a token bucket, replayed for every step of up to
that many tokens) knows only its padded sizes, T tokens and B rows. Its grid is fixed by them:
T // BLOCK_Q + B + 1 query blocks per KV head, each of BLOCK_Q queries times the KV head's query
heads (one tile for the whole group, so each key tile is read once for all of them). A program
finds its row by a binary search over the rows' first blocks (row i's are from
query_start[i] // BLOCK_Q + i: a row never needs more than that bound), and exits when its block
is past the row's queries; the blocks past every row write 0 for the tokens that belong to none.
A large bucket splits each query block's keys among SPLITS programs, whose partial results are
merged by their log-sum-exp (``captured_config``).
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
    last_dim_contiguous,
    next_power_of_2,
    upcast_in_kernel,
)
from corelib_cuda.triton_ops.decode_attention import (
    attend_tile,
    load_kv_tile,
    merge_partials,
    paged_decode_attention,
)

_OP = "paged_attention"


@triton.jit
def _chunk_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, sl_ptr, qs_ptr, out_ptr, scale, block_size,
    q_s0, q_s1, kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, bt_s0,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    tile, row, head = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    start = tl.load(qs_ptr + row)
    queries = (tl.load(qs_ptr + row + 1) - start).to(tl.int32)
    first = tile * BLOCK_M
    if first >= queries:
        return
    seq_len = tl.load(sl_ptr + row).to(tl.int32)
    j = first + tl.arange(0, BLOCK_M)
    q_ok = j < queries
    q_pos = seq_len - queries + j  # each query's position in its sequence
    d = tl.arange(0, DIM_PAD)
    d_ok = d < HEAD_DIM
    token = start + j  # int64: the query's index among the step's tokens
    q = tl.load(q_ptr + (token * q_s0 + head * q_s1)[:, None] + d[None, :], mask=q_ok[:, None] & d_ok[None, :],
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    kv_head = head // GROUP
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)  # noqa: E741 - the flash-attention name
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table = bt_ptr + row * bt_s0
    # Keys up to the tile's last live query: causal, so later keys are never read.
    end = tl.minimum(seq_len, seq_len - queries + tl.minimum(first + BLOCK_M, queries))
    for key_first in range(0, end, BLOCK_N):
        pos = key_first + tl.arange(0, BLOCK_N)
        live = pos < end
        k, v = load_kv_tile(kc_ptr, vc_ptr, table, pos, live, d, d_ok, kv_head, block_size,
                            kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, UPCAST)
        # Key 0 is visible to every query (q_pos >= 0), so no row is all -inf.
        visible = (pos[None, :] <= q_pos[:, None]) & live[None, :]
        m, l, acc = attend_tile(q, k, v, visible, m, l, acc, scale, PRECISION)  # noqa: E741
    heads = tl.num_programs(2)
    tl.store(out_ptr + (token * heads + head)[:, None] * HEAD_DIM + d[None, :], acc / l[:, None],
             mask=q_ok[:, None] & d_ok[None, :])


@triton.jit
def _block_row(qs_ptr, pid, num_rows, BLOCK_Q: tl.constexpr):
    """The row whose query blocks hold program ``pid``: the last r in [0, num_rows] whose first block,
    query_start[r] // BLOCK_Q + r, is at most ``pid`` (num_rows: past every row)."""
    left: tl.int32 = 0
    right = left + num_rows + 1
    while left < right:
        mid = (left + right) // 2
        if tl.load(qs_ptr + mid) // BLOCK_Q + mid <= pid:
            left = mid + 1
        else:
            right = mid
    return left - 1


#: log2(e): the captured kernel's softmax runs in base 2, its scores scaled once by scale * LOG2E
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # the partials' log-sum-exp back to base e


@triton.jit
def _attend_tiles(q, kc_ptr, vc_ptr, table, key_first, key_end, q_pos, m_i, l_i, acc, qk_scale, d, d_ok, kv_head,
                  kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                  PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, SAFE: tl.constexpr,
                  UPCAST: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Online softmax of a query tile (queries at positions ``q_pos``) over one sequence's keys [key_first, key_end),
    read through its block table, in base 2 (``qk_scale``: scale * LOG2E). Unmasked (MASKED False): every key
    exists and every query sees it, so the tiles load and score without predicates; masked: keys past key_end or
    past a query's position are left out. SAFE: a tile may hold no key some query sees (a later split's first
    tiles), whose max stays -inf."""
    for first in range(key_first, key_end, BLOCK_N):
        pos = first + tl.arange(0, BLOCK_N)
        if MASKED:
            live = pos < key_end
            k, v = load_kv_tile(kc_ptr, vc_ptr, table, pos, live, d, d_ok, kv_head, PAGE,
                                kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, UPCAST)
        else:  # whole pages of live keys: no predicate but the head's padding
            block = tl.load(table + pos // PAGE).to(tl.int64)
            offset = pos % PAGE
            k_at = kc_ptr + (block * kc_sb + offset * kc_st + kv_head * kc_sh)[:, None] + d[None, :]
            v_at = vc_ptr + (block * vc_sb + offset * vc_st + kv_head * vc_sh)[:, None] + d[None, :]
            if HEAD_DIM == DIM_PAD:
                k, v = tl.load(k_at), tl.load(v_at)
            else:
                k, v = tl.load(k_at, mask=d_ok[None, :], other=0.0), tl.load(v_at, mask=d_ok[None, :], other=0.0)
            if UPCAST:
                k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if MASKED:
            s = tl.where((pos[None, :] <= q_pos[:, None]) & live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = m_new
        if SAFE:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["num_rows", "num_tokens"])
def _captured_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, sl_ptr, qs_ptr, out_ptr, part_out_ptr, part_lse_ptr, qk_scale,
    num_rows, num_tokens, q_s0, q_s1, kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, bt_s0,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PAGE: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = _block_row(qs_ptr, pid, num_rows, BLOCK_Q)
    start = tl.load(qs_ptr + row)
    local = pid - (start // BLOCK_Q + row)  # this program's block among its row's
    m = tl.arange(0, BLOCK_M)
    j = local * BLOCK_Q + m // GROUP  # the query each tile row holds, counted from the row's first
    head = kv_head * GROUP + m % GROUP
    m_ok = m < BLOCK_Q * GROUP
    d = tl.arange(0, DIM_PAD)
    d_ok = d < HEAD_DIM
    token = start + j  # int64: the query's index among the step's tokens
    heads = tl.num_programs(1) * GROUP
    out_row = token * heads + head  # a row of the output [T * nh, hd]
    if row == num_rows:  # past every row: the padding tokens' output is 0
        tail = m_ok & (token < num_tokens)
        zeros = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
        if SPLITS == 1:
            tl.store(out_ptr + out_row[:, None] * HEAD_DIM + d[None, :], zeros.to(out_ptr.dtype.element_ty),
                     mask=tail[:, None] & d_ok[None, :])
        else:  # a zero partial of weight 1 in split 0, none in the others
            part_row = out_row * SPLITS + split
            tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + d[None, :], zeros,
                     mask=tail[:, None] & d_ok[None, :])
            weight = tl.where(split == 0, 0.0, float("-inf")) + tl.zeros([BLOCK_M], tl.float32)
            tl.store(part_lse_ptr + part_row, weight, mask=tail)
        return
    queries = tl.load(qs_ptr + row + 1) - start
    if local * BLOCK_Q >= queries:
        return
    seq_len = tl.load(sl_ptr + row)
    q_ok = m_ok & (j < queries)
    q = tl.load(q_ptr + (token * q_s0 + head * q_s1)[:, None] + d[None, :], mask=q_ok[:, None] & d_ok[None, :],
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = seq_len - queries + j  # each query's position in its sequence (>= 0: key 0 is always visible)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table = bt_ptr + row.to(tl.int64) * bt_s0
    # Keys up to the block's last live query: causal, so later keys are never read.
    end = (seq_len - queries + tl.minimum((local + 1) * BLOCK_Q, queries)).to(tl.int32)
    # This split's share of them, in whole key tiles; split 0 holds key 0, which every query sees.
    per_split = tl.cdiv(tl.cdiv(end, SPLITS), BLOCK_N) * BLOCK_N
    first_key = split * per_split
    last_key = tl.minimum(first_key + per_split, end)
    # Keys up to the block's first query's position are seen by every query of the block: whole tiles of them
    # run unmasked, the rest (the causal edge, the share's end) masked.
    seen_by_all = (seq_len - queries + local * BLOCK_Q + 1).to(tl.int32)
    full_end = first_key + tl.maximum(tl.minimum(last_key, seen_by_all) - first_key, 0) // BLOCK_N * BLOCK_N
    m_i, l_i, acc = _attend_tiles(q, kc_ptr, vc_ptr, table, first_key, full_end, q_pos, m_i, l_i, acc, qk_scale,
                                  d, d_ok, kv_head, kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, HEAD_DIM, DIM_PAD, PAGE,
                                  BLOCK_N, False, False, UPCAST, PRECISION)
    m_i, l_i, acc = _attend_tiles(q, kc_ptr, vc_ptr, table, full_end, last_key, q_pos, m_i, l_i, acc, qk_scale,
                                  d, d_ok, kv_head, kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, HEAD_DIM, DIM_PAD, PAGE,
                                  BLOCK_N, True, SPLITS > 1, UPCAST, PRECISION)
    if SPLITS == 1:
        tl.store(out_ptr + out_row[:, None] * HEAD_DIM + d[None, :], acc / l_i[:, None],
                 mask=q_ok[:, None] & d_ok[None, :])
    else:  # partials [T, nh, SPLITS, (hd | 1)], merged by their natural log-sum-exp; an empty share weighs 0
        empty = l_i == 0.0
        part_row = out_row * SPLITS + split
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + d[None, :], acc / tl.where(empty, 1.0, l_i)[:, None],
                 mask=q_ok[:, None] & d_ok[None, :])
        lse = (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2
        tl.store(part_lse_ptr + part_row, tl.where(empty, float("-inf"), lse), mask=q_ok)


class CapturedConfig(NamedTuple):
    block_m: int  # tile rows: BLOCK_Q queries times the KV head's query heads
    block_q: int
    block_n: int
    dim_pad: int
    warps: int
    stages: int = 3
    splits: int = 1  # programs per query block, each over a share of its keys, merged after (a power of 2)


#: buckets of at most this many token slots split each query block's keys in two (few query blocks, long rows)
SPLIT_BUCKET = 256


@functools.lru_cache(maxsize=64)
def captured_config(group: int, head_dim: int, tokens: int = 0, rows: int = 0) -> CapturedConfig:
    """The captured step's tiles for a bucket of ``tokens`` token slots (``rows`` row slots): 64 tile rows (queries
    times the group's heads, or the group if larger), 64 keys, 4 warps; 3 stages at heads of 64, 2 at 128; past
    128-wide heads 32 tile rows and 32 keys, for shared memory. Buckets up to SPLIT_BUCKET tokens split each query
    block's keys in two.

    Measured on an H200 (benchmarks/captured_attention.py --against the kernel before, which took 32-row tiles of
    128 keys; 16 query and 8 KV heads, bf16, graph-replayed, µs per layer), heads of 64 / 128:
    - 32 decoders 300 tokens in beside a 512-token chunk: 33.9 / 61.8 against 55.1 / 91.1;
    - the same decoders 2,000 tokens in: 63.7 / 140.5 against 97.4 / 155.3;
    - one 2,000-token prompt: 56.7 / 93.5 against 94.3 / 179.6;
    - 16 decoders beside 32 new tokens of a 1,056-token prompt (a 128-token bucket), split in two: 19.3 / 35.7
      against 25.2 / 44.7.
    """
    dim_pad = next_power_of_2(head_dim)
    splits = 2 if 0 < tokens <= SPLIT_BUCKET else 1
    if dim_pad <= 128:
        block_m = max(64, next_power_of_2(group))
        return CapturedConfig(block_m, block_m // group, 64, dim_pad, 4, 3 if dim_pad <= 64 else 2, splits)
    block_m = max(32, next_power_of_2(group))
    return CapturedConfig(block_m, block_m // group, 32, dim_pad, 4, 2, splits)


def _captured_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: PagedAttention,
                        scale: float) -> torch.Tensor:
    """paged_attention of a captured step: the grid from T and B alone (module docstring)."""
    tokens, heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    tables, seq_lens, starts = attn.block_tables, attn.seq_lens, attn.query_start
    rows = tables.shape[0]
    check(starts is not None and starts.shape == (rows + 1,), _OP, "a captured step needs query_start [B+1]")
    assert starts is not None
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    q = last_dim_contiguous(q)
    group = heads // kv_heads
    config = captured_config(group, head_dim, tokens, rows)
    splits = config.splits
    if splits > 1:
        part_out = torch.empty((tokens, heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((tokens, heads, splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused: the kernel writes the output itself
    grid = (tokens // config.block_q + rows + 1, kv_heads, splits)
    _captured_kernel[grid](
        q, k_cache, v_cache, tables, seq_lens, starts, out, part_out, part_lse, scale * LOG2E, rows, tokens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, DIM_PAD=config.dim_pad, BLOCK_M=config.block_m, BLOCK_Q=config.block_q,
        BLOCK_N=config.block_n, SPLITS=splits, PAGE=block_size, UPCAST=upcast_in_kernel(),
        PRECISION=dot_precision(q.dtype), num_warps=config.warps, num_stages=config.stages,
    )  # fmt: skip
    if splits > 1:
        merge_partials[(tokens * heads,)](part_out, part_lse, out, SPLITS=splits, HEAD_DIM=head_dim,
                                          DIM_PAD=config.dim_pad, PDL=False)
    return out


@functools.lru_cache(maxsize=16)
def _config(head_dim: int) -> tuple[int, int, int, int]:
    """(padded head dim, query tile, key tile, warps)."""
    dim_pad = next_power_of_2(head_dim)
    return (dim_pad, 64, 64, 4) if dim_pad <= 64 else (dim_pad, 64, 32, 4)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: PagedAttention, scale: float, *,
    pdl: bool = False,
) -> torch.Tensor:
    # q [T, nh, hd], k_cache / v_cache [NB, bs, nkv, hd], block_tables [B, W], seq_lens [B], query_start [B+1]
    if attn.is_decode and not attn.captured:
        return paged_decode_attention(q, k_cache, v_cache, attn, scale, pdl=pdl)
    if attn.decode_rows:  # the decode rows by flash-decoding, split over their context; the chunks here
        decode, chunks = attn.split()
        d = attn.decode_rows
        return torch.cat([paged_decode_attention(q[:d], k_cache, v_cache, decode, scale),
                          paged_attention(q[d:], k_cache, v_cache, chunks, scale)])
    check_float(_OP, q=q, k_cache=k_cache)
    check(q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape, _OP,
          f"expected q [T, nh, hd] and caches [NB, bs, nkv, hd]; got q {tuple(q.shape)}, "
          f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    tokens, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    check(k_cache.shape[3] == head_dim and heads % kv_heads == 0, _OP,
          f"q has {heads} heads of {head_dim}; the caches {kv_heads} of {k_cache.shape[3]} (nh % nkv == 0)")
    check(q.dtype == k_cache.dtype == v_cache.dtype, _OP, "q and the caches need one dtype")
    tables, seq_lens, starts = attn.block_tables, attn.seq_lens, attn.query_start
    check(starts is not None and starts.shape == (tables.shape[0] + 1,), _OP,
          "a step of several queries per row needs query_start [B+1]")
    assert starts is not None
    check(block_size == attn.block_size, _OP, f"the caches hold blocks of {block_size}, attn says {attn.block_size}")
    check(k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and tables.stride(-1) == 1, _OP,
          "the caches and block_tables need a contiguous last dim")
    if attn.captured:
        return _captured_attention(q, k_cache, v_cache, attn, scale)
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    rows = tables.shape[0]
    if tokens == 0 or rows == 0:
        return out
    q = last_dim_contiguous(q)
    dim_pad, block_m, block_n, warps = _config(head_dim)
    grid = (triton.cdiv(attn.max_query_len, block_m), rows, heads)
    _chunk_kernel[grid](
        q, k_cache, v_cache, tables, seq_lens, starts, out, scale, block_size,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), tables.stride(0),
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=upcast_in_kernel(), PRECISION=dot_precision(q.dtype), num_warps=warps,
    )  # fmt: skip
    return out
