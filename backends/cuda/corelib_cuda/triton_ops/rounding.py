# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False, disallow-untyped-decorators=False
# ruff: noqa: N803, SIM300 - upper-case compile-time constants, as in every Triton kernel
"""Rounding float32 to the model dtype inside a kernel, the same on a GPU and in Triton's interpreter."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rounded(x, DTYPE: tl.constexpr, RNE: tl.constexpr):
    """float32 x rounded to DTYPE (to nearest, ties to even), kept in float32.

    RNE: round bfloat16 by hand (pass ``common.interpreting()``): Triton's CPU interpreter
    truncates when it converts to bfloat16, where a GPU rounds to nearest.
    """
    if RNE and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE).to(tl.float32)
