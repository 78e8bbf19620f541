# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False, disallow-untyped-decorators=False
# ruff: noqa: N803 - compile-time constants are upper case, as in every Triton kernel
"""SiLU(gate) * up over the fused gate_up output: one read, half the bytes written."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corelib_cuda.triton_ops.common import check, check_float, interpreting, last_dim_contiguous
from corelib_cuda.triton_ops.rounding import rounded

_OP = "silu_mul"
_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, x_s0, BLOCK: tl.constexpr, RNE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * x_s0 + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_s0 + inter + cols, mask=ok, other=0.0).to(tl.float32)
    # The reference rounds silu(gate) to the model dtype before the product.
    dtype = out_ptr.dtype.element_ty
    silu = rounded(gate / (1.0 + tl.exp(-gate)), dtype, RNE)
    tl.store(out_ptr + row * inter + cols, rounded(silu * up, dtype, RNE).to(dtype), mask=ok)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    # x [T, 2I] (gate then up) -> [T, I]
    check_float(_OP, x=x)
    check(x.dim() == 2 and x.shape[1] % 2 == 0, _OP, f"expected x [T, 2I]; got {tuple(x.shape)}")
    tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((tokens, inter), dtype=x.dtype, device=x.device)
    if tokens == 0 or inter == 0:
        return out
    x = last_dim_contiguous(x)
    _silu_mul_kernel[(tokens, triton.cdiv(inter, _BLOCK))](x, out, inter, x.stride(0), BLOCK=_BLOCK, RNE=interpreting(),
                                                              num_warps=4)
    return out
