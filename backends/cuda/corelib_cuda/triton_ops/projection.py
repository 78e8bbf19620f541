# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False, disallow-untyped-decorators=False
# ruff: noqa: N803, SIM108 - upper-case compile-time constants; constexpr branches read plainer than ternaries
"""One projection kernel family for the decode layer: y = x @ W.T with a prologue and an epilogue.

Two kernels share the row mapping and the epilogues:

- ``gemv_kernel`` (few rows of x, CUDA cores): each program loads its whole weight tile
  [rows, K chunk] into registers at once, *before* it waits for the previous kernel (PDL), then
  reads the activations and multiplies every row of x against it with float32 accumulation;
- ``gemm_kernel`` (more rows, tensor cores): [BLOCK_M, BLOCK_N] tiles over a K loop, its first
  weight tile loaded before the PDL wait; with SWAP the weight tile is the MMA's row side and the
  few rows of x its narrow side (the accumulator transposed before the epilogue).

Prologue (NORM): in the GEMV x is rms_norm(x) * norm_weight, rounded to the model dtype as the
reference rounds it; each program computes the statistics of its rows over the whole of K itself.
The tensor-core kernel reads x once: its tiles are x * norm_weight (rounded once, for the tensor
cores), it sums the rows' squares over its own K range as it goes (split-K programs store theirs
beside their partials), and the rows' 1/rms scales the products once K is summed. It rounds one
product where the reference rounds two, within the dtype's tolerance of it, and no program
reads the whole of K for the statistics (at 32 rows that second read cost more than the norm's
own kernel). Without NORM_WEIGHT the norm's weight is folded into W (``fold_norm_weight``): the
rows are normalized with a unit weight.
Paired rows (PAIRED): each output column reads two weight rows, a and b: gate and up for
SiLU-and-multiply (b = a + I), or a feature and its rotate-half partner for RoPE
(b = a + hd/2 within a head), so a program always holds both halves it combines.
Stacked pairs (STACKED, the tensor-core kernel with SWAP): a program's a rows and b rows are one
weight tile of 2 * BLOCK_N rows, a's then b's, so one MMA of twice the rows replaces two (Hopper's
MMA takes 64 weight rows at least: 32 output columns a program, twice the programs of two 64-row
tiles); the accumulator is split into a's and b's after the K loop.
Epilogues (MODE): STORE (+bias), RESIDUAL (product rounded, then + residual), SILU
(silu(a) * b), ROPE (rotate q and k, write q out, k and v into the paged cache), LOGITS
(float32, unrounded).
Split-K: programs of one column block each store a float32 partial; an atomic counter per
block elects the last one to finish, which sums the partials in split order (deterministic,
whatever order they finished in), runs the epilogue and resets the counter for the next launch.

TMA (the tensor-core kernel, off unless ``Tuning.gemm_tma``): the weight tiles come through a tensor descriptor
(Hopper's tensor memory accelerator) instead of pointer loads; every split's K range must be whole K tiles (the
descriptor's zeros end the last), and ROPE's paired rows (not one run of rows) keep pointer loads.
PDL: with PDL set each kernel lets its dependents launch at once, loads only weights (which no
kernel writes) before ``gdc_wait``, and reads or writes activations, caches, partials and
counters only after it, so it is safe to launch with ``launch_pdl``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from corelib_cuda.triton_ops.rounding import rounded

STORE, RESIDUAL, SILU, ROPE, LOGITS = 0, 1, 2, 3, 4


@triton.jit
def _columns(pid, n_out, pair_offset, BLOCK: tl.constexpr, MODE: tl.constexpr, HALF: tl.constexpr):
    """Output columns of column block ``pid`` and the weight rows (a, b) each one reads."""
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    row_a, row_b = _rows(cols, pair_offset, MODE, HALF)
    return cols, cols < n_out, row_a, row_b


@triton.jit
def _rows(cols, pair_offset, MODE: tl.constexpr, HALF: tl.constexpr):
    """The weight rows (a, b) output columns ``cols`` read."""
    if MODE == 3:  # ROPE: pair (d, d + hd/2) of one head
        row_a = (cols // HALF) * (2 * HALF) + cols % HALF
        row_b = row_a + HALF
    else:  # SILU: gate row p and up row I + p; otherwise one row per column
        row_a = cols
        row_b = cols + pair_offset
    return row_a.to(tl.int64), row_b.to(tl.int64)


@triton.jit
def _stacked_rows(pid, n_out, pair_offset, BLOCK: tl.constexpr, MODE: tl.constexpr, HALF: tl.constexpr):
    """STACKED: the 2 * BLOCK weight rows of column block ``pid`` as one tile, its a rows then its b rows, and
    which of them are in range."""
    at = tl.arange(0, 2 * BLOCK)
    cols = pid * BLOCK + at % BLOCK
    row_a, row_b = _rows(cols, pair_offset, MODE, HALF)
    return tl.where(at < BLOCK, row_a, row_b), cols < n_out


@triton.jit
def _normed(x, rstd, nw, DTYPE: tl.constexpr, RNE: tl.constexpr, NORM_WEIGHT: tl.constexpr):
    # the reference: weight * rms_norm(h.float()).to(dtype), the product in the model dtype (without
    # NORM_WEIGHT the weight is folded into the projection's: rms_norm(h.float()).to(dtype))
    if NORM_WEIGHT:
        return rounded(rounded(x * rstd, DTYPE, RNE) * nw, DTYPE, RNE)
    return rounded(x * rstd, DTYPE, RNE)


@triton.jit
def _epilogue(
    acc_a, acc_b, ms, m_ok, cols, c_ok, row_a, row_b,
    out_ptr, out_s0, res_ptr, res_s0, bias_ptr,
    pos_ptr, cs_ptr, cs_s0, cs_s1, kc_ptr, vc_ptr, slot_ptr,
    kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, block_size,
    MODE: tl.constexpr, HAS_BIAS: tl.constexpr, DTYPE: tl.constexpr,
    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HALF: tl.constexpr, RNE: tl.constexpr,
):  # fmt: skip
    # acc_a, acc_b [BM, BN] float32; ms [BM] rows of x; cols [BN] output columns
    bias_a, bias_b, residual, c1, c2, s1, s2, slot = _epilogue_inputs(
        ms, m_ok, cols, c_ok, row_a, row_b, res_ptr, res_s0, bias_ptr, pos_ptr, cs_ptr, cs_s0, cs_s1, slot_ptr,
        MODE, HAS_BIAS, HALF)  # fmt: skip
    _epilogue_from(acc_a, acc_b, bias_a, bias_b, residual, c1, c2, s1, s2, slot, ms, m_ok, cols, c_ok,
                   out_ptr, out_s0, kc_ptr, vc_ptr, kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, block_size,
                   MODE, HAS_BIAS, DTYPE, NUM_Q, NUM_KV, HALF, RNE)  # fmt: skip


@triton.jit
def _epilogue_inputs(
    ms, m_ok, cols, c_ok, row_a, row_b, res_ptr, res_s0, bias_ptr, pos_ptr, cs_ptr, cs_s0, cs_s1, slot_ptr,
    MODE: tl.constexpr, HAS_BIAS: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """What an epilogue reads besides the products (bias, residual, RoPE's cos and sin, the cache slots), loaded
    on their own so that a kernel may issue them before its reduction, their latency hidden behind it."""
    mask = m_ok[:, None] & c_ok[None, :]
    unused = tl.zeros([1, 1], tl.float32)
    bias_a, bias_b, residual, c1, c2, s1, s2 = unused, unused, unused, unused, unused, unused, unused
    slot = tl.zeros([1], tl.int32)
    if HAS_BIAS:
        bias_a = tl.load(bias_ptr + row_a, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        bias_b = tl.load(bias_ptr + row_b, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    if MODE == 1:  # RESIDUAL
        residual = tl.load(res_ptr + ms[:, None] * res_s0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    elif MODE == 3:  # ROPE
        pos = tl.load(pos_ptr + ms, mask=m_ok, other=0)
        cs = cs_ptr + pos[:, None] * cs_s0 + (cols % HALF)[None, :]
        c1 = tl.load(cs, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cs + HALF, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(cs + cs_s1, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(cs + cs_s1 + HALF, mask=mask, other=0.0).to(tl.float32)
        slot = tl.load(slot_ptr + ms, mask=m_ok, other=-1)
    return bias_a, bias_b, residual, c1, c2, s1, s2, slot


@triton.jit
def _epilogue_from(
    acc_a, acc_b, bias_a, bias_b, residual, c1, c2, s1, s2, slot, ms, m_ok, cols, c_ok,
    out_ptr, out_s0, kc_ptr, vc_ptr, kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, block_size,
    MODE: tl.constexpr, HAS_BIAS: tl.constexpr, DTYPE: tl.constexpr,
    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HALF: tl.constexpr, RNE: tl.constexpr,
):  # fmt: skip
    """The epilogue of products ``acc_a``, ``acc_b`` with its inputs loaded (``_epilogue_inputs``)."""
    mask = m_ok[:, None] & c_ok[None, :]
    if HAS_BIAS:
        acc_a += bias_a
        acc_b += bias_b
    dst = out_ptr + ms[:, None] * out_s0 + cols[None, :]
    if MODE == 0:  # STORE
        tl.store(dst, rounded(acc_a, DTYPE, RNE).to(DTYPE), mask=mask)
    elif MODE == 4:  # LOGITS
        tl.store(dst, acc_a, mask=mask)
    elif MODE == 1:  # RESIDUAL
        tl.store(dst, rounded(rounded(acc_a, DTYPE, RNE) + residual, DTYPE, RNE).to(DTYPE), mask=mask)
    elif MODE == 2:  # SILU: silu(gate) rounded, times up (as silu_mul on the rounded gate_up)
        gate = rounded(acc_a, DTYPE, RNE)
        up = rounded(acc_b, DTYPE, RNE)
        silu = rounded(gate / (1.0 + tl.exp(-gate)), DTYPE, RNE)
        tl.store(dst, rounded(silu * up, DTYPE, RNE).to(DTYPE), mask=mask)
    else:  # ROPE
        x1 = rounded(acc_a, DTYPE, RNE)
        x2 = rounded(acc_b, DTYPE, RNE)
        head = cols // HALF
        d = cols % HALF
        # x * cos + rotate_half(x) * sin with each product rounded, as the reference computes it
        o1 = rounded(x1 * c1, DTYPE, RNE) + rounded(-x2 * s1, DTYPE, RNE)
        o2 = rounded(x2 * c2, DTYPE, RNE) + rounded(x1 * s2, DTYPE, RNE)
        rotated = (head < NUM_Q + NUM_KV)[None, :]
        o1 = rounded(tl.where(rotated, o1, x1), DTYPE, RNE).to(DTYPE)
        o2 = rounded(tl.where(rotated, o2, x2), DTYPE, RNE).to(DTYPE)
        is_q = (head < NUM_Q)[None, :]
        q_dst = out_ptr + ms[:, None] * out_s0 + (head * (2 * HALF) + d)[None, :]
        tl.store(q_dst, o1, mask=mask & is_q)
        tl.store(q_dst + HALF, o2, mask=mask & is_q)
        live = (m_ok & (slot >= 0))[:, None] & c_ok[None, :]  # a negative slot (padding) writes nothing
        block = slot // block_size
        offset = slot % block_size
        is_k = ((head >= NUM_Q) & (head < NUM_Q + NUM_KV))[None, :]
        k_dst = kc_ptr + (block * kc_sb + offset * kc_st)[:, None] + ((head - NUM_Q) * kc_sh + d)[None, :]
        tl.store(k_dst, o1, mask=live & is_k)
        tl.store(k_dst + HALF, o2, mask=live & is_k)
        is_v = (head >= NUM_Q + NUM_KV)[None, :]
        v_dst = vc_ptr + (block * vc_sb + offset * vc_st)[:, None] + ((head - NUM_Q - NUM_KV) * vc_sh + d)[None, :]
        tl.store(v_dst, o1, mask=live & is_v)
        tl.store(v_dst + HALF, o2, mask=live & is_v)


@triton.jit
def _row_rstd(x_ptr, x_s0, ms, m_ok, K, eps, BLOCK_K: tl.constexpr):
    """1 / rms of rows ``ms`` of x [M, K], over the whole of K: [BM] float32."""
    total = tl.zeros([ms.shape[0]], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + ms[:, None] * x_s0 + ks[None, :], mask=m_ok[:, None] & (ks < K)[None, :], other=0.0)
        x = x.to(tl.float32)
        total += tl.sum(x * x, axis=1)
    return 1.0 / tl.sqrt(total / K + eps)


@triton.jit
def gemv_kernel(
    x_ptr, w_ptr, nw_ptr, part_ptr, count_ptr,
    out_ptr, out_s0, res_ptr, res_s0, bias_ptr,
    pos_ptr, cs_ptr, cs_s0, cs_s1, kc_ptr, vc_ptr, slot_ptr,
    kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, block_size,
    M, n_out, K, x_s0, w_s0, pair_offset, eps,
    MODE: tl.constexpr, PAIRED: tl.constexpr, NORM: tl.constexpr, NORM_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr, RNE: tl.constexpr,
    EARLY: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    split = tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    cols, c_ok, row_a, row_b = _columns(pid, n_out, pair_offset, BLOCK_N, MODE, HALF)
    ks = split * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    w_mask = c_ok[:, None] & k_ok[None, :]
    # The weights first: nothing writes them, so they may stream in while the previous kernel ends.
    w_a = tl.load(w_ptr + row_a[:, None] * w_s0 + ks[None, :], mask=w_mask, other=0.0)
    if PAIRED:
        w_b = tl.load(w_ptr + row_b[:, None] * w_s0 + ks[None, :], mask=w_mask, other=0.0)
    nw = 1.0
    if NORM and NORM_WEIGHT:
        nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    dtype = x_ptr.dtype.element_ty
    w_a = w_a.to(tl.float32)
    if PAIRED:
        w_b = w_b.to(tl.float32)
    for m in range(0, M):
        ms = m + tl.zeros([1], tl.int64)
        if EARLY and SPLIT_K == 1:  # the epilogue's loads issued now: their latency overlaps x's and the reduction
            bias_a, bias_b, residual, c1, c2, s1, s2, slot = _epilogue_inputs(
                ms, ms < M, cols, c_ok, row_a, row_b, res_ptr, res_s0, bias_ptr, pos_ptr, cs_ptr, cs_s0, cs_s1,
                slot_ptr, MODE, HAS_BIAS, HALF)  # fmt: skip
        x = tl.load(x_ptr + m * x_s0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        if NORM:
            if SPLIT_K == 1:  # the chunk is the whole row
                rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
            else:
                rstd = tl.sum(_row_rstd(x_ptr, x_s0, ms, ms < M, K, eps, BLOCK_K), axis=0)
            x = _normed(x, rstd, nw, dtype, RNE, NORM_WEIGHT)
        acc_a = tl.sum(w_a * x[None, :], axis=1)[None, :]  # [1, BLOCK_N]
        if PAIRED:
            acc_b = tl.sum(w_b * x[None, :], axis=1)[None, :]
        else:
            acc_b = acc_a
        if SPLIT_K == 1:
            if not EARLY:  # the epilogue's loads after the reduction
                bias_a, bias_b, residual, c1, c2, s1, s2, slot = _epilogue_inputs(
                    ms, ms < M, cols, c_ok, row_a, row_b, res_ptr, res_s0, bias_ptr, pos_ptr, cs_ptr, cs_s0, cs_s1,
                    slot_ptr, MODE, HAS_BIAS, HALF)  # fmt: skip
            _epilogue_from(acc_a, acc_b, bias_a, bias_b, residual, c1, c2, s1, s2, slot, ms, ms < M, cols, c_ok,
                           out_ptr, out_s0, kc_ptr, vc_ptr, kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, block_size,
                           MODE, HAS_BIAS, dtype, NUM_Q, NUM_KV, HALF, RNE)  # fmt: skip
        else:
            # partials [2, SPLIT_K, M, n_out]: the a half, then the b half
            part = part_ptr + (split * M + m) * n_out + cols
            tl.store(part[None, :], acc_a, mask=c_ok[None, :])
            if PAIRED:
                tl.store(part[None, :] + SPLIT_K * M * n_out, acc_b, mask=c_ok[None, :])
    if SPLIT_K > 1:
        tl.debug_barrier()  # every thread's partial is stored before the counter moves
        arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last of this column block: reduce, in split order
            for m in range(0, M):
                ms = m + tl.zeros([1], tl.int64)
                acc_a = tl.zeros([1, BLOCK_N], tl.float32)
                acc_b = tl.zeros([1, BLOCK_N], tl.float32)
                for s in range(0, SPLIT_K):
                    part = part_ptr + (s * M + m) * n_out + cols
                    acc_a += tl.load(part[None, :], mask=c_ok[None, :], other=0.0, cache_modifier=".cg")
                    if PAIRED:
                        acc_b += tl.load(part[None, :] + SPLIT_K * M * n_out, mask=c_ok[None, :], other=0.0,
                                         cache_modifier=".cg")
                if not PAIRED:
                    acc_b = acc_a
                _epilogue(acc_a, acc_b, ms, ms < M, cols, c_ok, row_a, row_b,
                          out_ptr, out_s0, res_ptr, res_s0, bias_ptr,
                          pos_ptr, cs_ptr, cs_s0, cs_s1, kc_ptr, vc_ptr, slot_ptr,
                          kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, block_size,
                          MODE, HAS_BIAS, dtype, NUM_Q, NUM_KV, HALF, RNE)  # fmt: skip
            tl.store(count_ptr + pid, 0)  # ready for the next launch


@triton.jit
def _x_tile(x_ptr, x_s0, nw_ptr, ms, m_ok, ks, k_ok, NORM: tl.constexpr, NORM_WEIGHT: tl.constexpr,
            DTYPE: tl.constexpr, RNE: tl.constexpr):
    """Rows ``ms`` of x at columns ``ks`` [BLOCK_M, BLOCK_K] and their squares summed over ``ks`` [BLOCK_M].

    With NORM the tile is x * norm_weight, rounded once for the tensor cores (x itself without NORM_WEIGHT:
    the weight is folded into the projection's); the rows' 1/rms scales the products once K is summed
    (``_scaled``), so no program reads x twice."""
    x = tl.load(x_ptr + ms[:, None] * x_s0 + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    squares = tl.zeros([ms.shape[0]], tl.float32)
    if NORM:
        xf = x.to(tl.float32)
        squares = tl.sum(xf * xf, axis=1)
        if NORM_WEIGHT:
            nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            x = rounded(xf * nw[None, :], DTYPE, RNE).to(DTYPE)
    return x, squares


@triton.jit
def _scaled(acc_a, acc_b, squares, K, eps, NORM: tl.constexpr):
    """The products [BLOCK_M, BLOCK_N] times their rows' 1/rms (from the squares of the whole of K) with NORM."""
    if NORM:
        rstd = (1.0 / tl.sqrt(squares / K + eps))[:, None]
        acc_a = acc_a * rstd
        acc_b = acc_b * rstd
    return acc_a, acc_b


@triton.jit
def _w_tile(w_ptr, rows, ks, mask, w_s0, first_row, k0, TMA: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] of rows ``rows`` (from ``first_row`` on, in order) at columns ``ks`` (from
    ``k0``): with TMA ``w_ptr`` is a tensor descriptor of the weight, whose loads past its edges are zeros."""
    if TMA:
        return w_ptr.load([first_row, k0])
    else:
        return tl.load(w_ptr + rows[:, None] * w_s0 + ks[None, :], mask=mask, other=0.0)


@triton.jit
def _dot(acc, w, x, SWAP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + x @ w.T: [BLOCK_M, BLOCK_N], or its transpose [BLOCK_N, BLOCK_M] with SWAP (the weight tile
    as the MMA's row side, so a few rows of x fill the narrow side of a Hopper tensor-core tile)."""
    if UPCAST:
        x, w = x.to(tl.float32), w.to(tl.float32)
    if SWAP:
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def gemm_kernel(
    x_ptr, w_ptr, nw_ptr, part_ptr, count_ptr, stats_ptr,
    out_ptr, out_s0, res_ptr, res_s0, bias_ptr,
    pos_ptr, cs_ptr, cs_s0, cs_s1, kc_ptr, vc_ptr, slot_ptr,
    kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, block_size,
    M, n_out, K, x_s0, w_s0, pair_offset, eps, k_per_split,
    MODE: tl.constexpr, PAIRED: tl.constexpr, NORM: tl.constexpr, NORM_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr, RNE: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr, TMA: tl.constexpr = False,
    STACKED: tl.constexpr = False,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    dtype = x_ptr.dtype.element_ty
    cols, c_ok, row_a, row_b = _columns(pid_n, n_out, pair_offset, BLOCK_N, MODE, HALF)
    if STACKED:  # paired, SWAP, pointer loads: both halves' rows in one tile (the module docstring)
        rows_s, ok_s = _stacked_rows(pid_n, n_out, pair_offset, BLOCK_N, MODE, HALF)
    ms = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_ok = ms < M
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # The first weight tile before the PDL wait (nothing writes weights): it streams in while the
    # previous kernel ends. Activations, partials and counters only after the wait.
    ks = k_start + tl.arange(0, BLOCK_K)
    k_ok = ks < k_end
    first_a = pid_n * BLOCK_N  # TMA: the first weight row of the tile (rows run on from it: not ROPE's pairs)
    if STACKED:
        w_a = _w_tile(w_ptr, rows_s, ks, ok_s[:, None] & k_ok[None, :], w_s0, first_a, k_start, False)
    else:
        w_mask = c_ok[:, None] & k_ok[None, :]
        w_a = _w_tile(w_ptr, row_a, ks, w_mask, w_s0, first_a, k_start, TMA)
    if PAIRED and not STACKED:
        w_b = _w_tile(w_ptr, row_b, ks, w_mask, w_s0, first_a + pair_offset, k_start, TMA)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if STACKED:  # both halves in one accumulator (acc_b: its second half, after the K loop)
        acc_a = tl.zeros([2 * BLOCK_N, BLOCK_M], tl.float32)
    elif SWAP:
        acc_a = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_b = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc_a = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_b = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    x, squares = _x_tile(x_ptr, x_s0, nw_ptr, ms, m_ok, ks, k_ok, NORM, NORM_WEIGHT, dtype, RNE)
    acc_a = _dot(acc_a, w_a, x, SWAP, UPCAST, PRECISION)
    if PAIRED and not STACKED:
        acc_b = _dot(acc_b, w_b, x, SWAP, UPCAST, PRECISION)
    for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):  # the rest, pipelined
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        if STACKED:
            w_a = _w_tile(w_ptr, rows_s, ks, ok_s[:, None] & k_ok[None, :], w_s0, first_a, k0, False)
        else:
            w_mask = c_ok[:, None] & k_ok[None, :]
            w_a = _w_tile(w_ptr, row_a, ks, w_mask, w_s0, first_a, k0, TMA)
        x, more = _x_tile(x_ptr, x_s0, nw_ptr, ms, m_ok, ks, k_ok, NORM, NORM_WEIGHT, dtype, RNE)
        squares += more
        acc_a = _dot(acc_a, w_a, x, SWAP, UPCAST, PRECISION)
        if PAIRED and not STACKED:
            w_b = _w_tile(w_ptr, row_b, ks, w_mask, w_s0, first_a + pair_offset, k0, TMA)
            acc_b = _dot(acc_b, w_b, x, SWAP, UPCAST, PRECISION)
    if STACKED:  # [2 * BLOCK_N, BLOCK_M] -> a's [BLOCK_N, BLOCK_M] and b's
        acc_a, acc_b = tl.split(tl.permute(tl.reshape(acc_a, [2, BLOCK_N, BLOCK_M]), (1, 2, 0)))
    if SWAP:
        acc_a = tl.trans(acc_a)
        acc_b = tl.trans(acc_b)
    if not PAIRED:
        acc_b = acc_a
    if SPLIT_K == 1:
        acc_a, acc_b = _scaled(acc_a, acc_b, squares, K, eps, NORM)
        _epilogue(acc_a, acc_b, ms, m_ok, cols, c_ok, row_a, row_b,
                  out_ptr, out_s0, res_ptr, res_s0, bias_ptr,
                  pos_ptr, cs_ptr, cs_s0, cs_s1, kc_ptr, vc_ptr, slot_ptr,
                  kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, block_size,
                  MODE, HAS_BIAS, dtype, NUM_Q, NUM_KV, HALF, RNE)  # fmt: skip
    else:
        mask = m_ok[:, None] & c_ok[None, :]
        part = part_ptr + (split * M + ms)[:, None] * n_out + cols[None, :]
        tl.store(part, acc_a, mask=mask)
        if PAIRED:
            tl.store(part + SPLIT_K * M * n_out, acc_b, mask=mask)
        block = pid_m * tl.num_programs(1) + pid_n
        if NORM:  # this split's squares, [blocks, SPLIT_K, M]
            tl.store(stats_ptr + (block * SPLIT_K + split) * M + ms, squares, mask=m_ok)
        tl.debug_barrier()
        counter = count_ptr + block
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            acc_a = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_b = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            squares = tl.zeros([BLOCK_M], tl.float32)
            for s in range(0, SPLIT_K):
                part = part_ptr + (s * M + ms)[:, None] * n_out + cols[None, :]
                acc_a += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
                if PAIRED:
                    acc_b += tl.load(part + SPLIT_K * M * n_out, mask=mask, other=0.0, cache_modifier=".cg")
                if NORM:
                    squares += tl.load(stats_ptr + (block * SPLIT_K + s) * M + ms, mask=m_ok, other=0.0,
                                       cache_modifier=".cg")
            if not PAIRED:
                acc_b = acc_a
            acc_a, acc_b = _scaled(acc_a, acc_b, squares, K, eps, NORM)
            _epilogue(acc_a, acc_b, ms, m_ok, cols, c_ok, row_a, row_b,
                      out_ptr, out_s0, res_ptr, res_s0, bias_ptr,
                      pos_ptr, cs_ptr, cs_s0, cs_s1, kc_ptr, vc_ptr, slot_ptr,
                      kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, block_size,
                      MODE, HAS_BIAS, dtype, NUM_Q, NUM_KV, HALF, RNE)  # fmt: skip
            tl.store(counter, 0)


