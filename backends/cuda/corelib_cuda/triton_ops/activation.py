# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False, disallow-untyped-decorators=False
# ruff: noqa: N803 - compile-time constants are upper case, as in every Triton kernel
"""SiLU(gate) * up over the fused gate_up output: one read, half the bytes written."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corelib_cuda.triton_ops.common import check, check_float, interpreting, last_dim_contiguous
from corelib_cuda.triton_ops.norm import check_rows, row_chunk, row_rstd
from corelib_cuda.triton_ops.rounding import rounded

_OP = "silu_mul"
_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, h_ptr, inter, x_s0, h_s0, hidden, eps, BLOCK: tl.constexpr, RNE: tl.constexpr,
                     NORM_ROWS: tl.constexpr, ROW_CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * x_s0 + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_s0 + inter + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if NORM_ROWS:  # the product of h's rows before their norm (its weight folded in): scaled by 1/rms first
        rstd = row_rstd(h_ptr + row * h_s0, hidden, eps, ROW_CHUNK)
        gate = rounded(gate * rstd, dtype, RNE).to(tl.float32)
        up = rounded(up * rstd, dtype, RNE).to(tl.float32)
    # The reference rounds silu(gate) to the model dtype before the product.
    silu = rounded(gate / (1.0 + tl.exp(-gate)), dtype, RNE)
    tl.store(out_ptr + row * inter + cols, rounded(silu * up, dtype, RNE).to(dtype), mask=ok)


def silu_mul(x: torch.Tensor, *, rows: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """x [T, 2I] (gate then up) -> [T, I]. With ``rows`` [T, H] (h, whose norm's weight is folded into the
    gate/up weight that gave x from h itself), gate and up are first scaled by each row's 1/rms: the norm's
    kernel is not needed."""
    check_float(_OP, x=x)
    check(x.dim() == 2 and x.shape[1] % 2 == 0, _OP, f"expected x [T, 2I]; got {tuple(x.shape)}")
    tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((tokens, inter), dtype=x.dtype, device=x.device)
    if tokens == 0 or inter == 0:
        return out
    x = last_dim_contiguous(x)
    if rows is not None:
        check_rows(_OP, rows, tokens, x.dtype)
    hidden = 1 if rows is None else rows.shape[1]
    _silu_mul_kernel[(tokens, triton.cdiv(inter, _BLOCK))](
        x, out, x if rows is None else rows, inter, x.stride(0), 0 if rows is None else rows.stride(0), hidden, eps,
        BLOCK=_BLOCK, RNE=interpreting(), NORM_ROWS=rows is not None, ROW_CHUNK=row_chunk(hidden),
        num_warps=4,
    )  # fmt: skip
    return out
