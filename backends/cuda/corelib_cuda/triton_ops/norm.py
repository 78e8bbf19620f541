# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False, disallow-untyped-decorators=False
# ruff: noqa: N803 - compile-time constants are upper case, as in every Triton kernel
"""RMSNorm, with the residual add fused: one read of x (and the residual), one write of each output."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from corelib_cuda.triton_ops.common import check, check_float, interpreting, next_power_of_2
from corelib_cuda.triton_ops.rounding import rounded

_OP = "rms_norm"
_MAX_HIDDEN = 16384
_ROW_CHUNK = 1024  # elements of a row read at once by ``row_rstd``


@triton.jit
def row_rstd(x_ptr, width, eps, BLOCK: tl.constexpr):
    """1 / rms of one row of ``width`` elements at ``x_ptr``, in float32, read ``BLOCK`` at a time: for a kernel
    after a projection whose norm's weight is folded into it (the rows' scale, without the norm's kernel)."""
    total = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, width, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + ks, mask=ks < width, other=0.0).to(tl.float32)
        total += x * x
    return 1.0 / tl.sqrt(tl.sum(total, axis=0) / width + eps)


def row_chunk(width: int) -> int:
    """``row_rstd``'s BLOCK for rows of ``width``."""
    return min(_ROW_CHUNK, next_power_of_2(width))


def check_rows(op: str, rows: torch.Tensor, tokens: int, dtype: torch.dtype) -> None:
    """``rows`` [tokens, H] of ``dtype``, its last dim contiguous: the h whose 1/rms a kernel after a folded
    projection reads with ``row_rstd``."""
    check(rows.dim() == 2 and rows.shape[0] == tokens and rows.stride(-1) == 1 and rows.dtype == dtype, op,
          f"rows {rows.dtype} {tuple(rows.shape)}; expected {dtype} [{tokens}, H], its last dim contiguous")


# The row count changes with every step's tokens: not specialised, so one compiled kernel serves them all.
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, h_ptr,
    num_rows, inner, hidden, eps,
    x_s0, x_s1, r_s0, r_s1,
    HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, RNE: tl.constexpr,
):  # fmt: skip
    # A row r of x [outer, inner, H] sits at (r // inner) * s0 + (r % inner) * s1: the per-head
    # q/k norm reads [T, n, hd] straight out of the fused qkv output without a copy.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_ok = rows < num_rows
    col_ok = cols < hidden
    mask = row_ok[:, None] & col_ok[None, :]
    outer, within = rows // inner, rows % inner
    x = tl.load(x_ptr + (outer * x_s0 + within * x_s1)[:, None] + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    dense = rows[:, None] * hidden + cols[None, :]  # outputs are contiguous [rows, H]
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + (outer * r_s0 + within * r_s1)[:, None] + cols[None, :], mask=mask, other=0.0)
        # The sum is rounded to the model dtype, and the statistics use the rounded sum, as
        # the reference does (h = x + residual in the model dtype).
        x = rounded(x + r.to(tl.float32), h_ptr.dtype.element_ty, RNE)
        tl.store(h_ptr + dense, x.to(h_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / hidden + eps)
    dtype = out_ptr.dtype.element_ty
    normed = rounded(x * rstd[:, None], dtype, RNE)  # the reference rounds here
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + dense, rounded(normed * w[None, :], dtype, RNE).to(dtype), mask=mask)


@functools.lru_cache(maxsize=64)
def _config(hidden: int) -> tuple[int, int, int]:
    """(rows per program, padded H, warps): about 2048 values per program, at least one row."""
    block_h = next_power_of_2(hidden)
    rows = max(1, min(16, 2048 // block_h))
    warps = 4 if block_h * rows <= 4096 else 8
    return rows, block_h, warps


def _as_rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(tensor, inner, s0, s1) with rows of t addressed as (r // inner) * s0 + (r % inner) * s1."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() > 3:
        t = t.reshape(-1, t.shape[-1])
    if t.dim() == 3:
        return t, t.shape[1], t.stride(0), t.stride(1)
    if t.dim() == 2:
        return t, 1, t.stride(0), 0
    return t, 1, 0, 0


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    # x [..., H] (may be a strided view), weight [H], residual like x -> (normed [..., H], h [..., H])
    hidden = x.shape[-1]
    check_float(_OP, x=x, weight=weight)
    check(weight.shape == (hidden,), _OP, f"weight has shape {tuple(weight.shape)}; expected ({hidden},)")
    check(hidden <= _MAX_HIDDEN, _OP, f"hidden size {hidden} is above {_MAX_HIDDEN}; use the reference op")
    if residual is not None:
        check(residual.shape == x.shape and residual.dtype == x.dtype, _OP,
              f"residual is {residual.dtype} {tuple(residual.shape)}; expected x's {x.dtype} {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = x if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = x.numel() // max(hidden, 1)
    if num_rows == 0:
        return out, h
    xs, inner, x_s0, x_s1 = _as_rows(x)
    rs, _, r_s0, r_s1 = _as_rows(residual) if residual is not None else (xs, inner, 0, 0)
    rows, block_h, warps = _config(hidden)
    _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        xs, rs, weight, out, h,
        num_rows, inner, hidden, eps,
        x_s0, x_s1, r_s0, r_s1,
        HAS_RESIDUAL=residual is not None, ROWS=rows, BLOCK_H=block_h, RNE=interpreting(), num_warps=warps,
    )  # fmt: skip
    return out, h
