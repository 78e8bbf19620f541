"""The projection ops: ``linear`` and the fused ops of the decode layer, over ``projection``'s kernels.

Which kernel runs is chosen by the rows of x (M), with thresholds measured on an H200
(``Tuning``; benchmarks/decode_floor.sh prints the sweep they come from):

- M <= ``gemv_max_m``: the GEMV, float32 accumulation on CUDA cores, its weight tile loaded
  before the PDL wait;
- M <= ``gemm_max_m``: the tensor-core kernel, split over K when the output alone gives too
  few programs to fill the GPU;
- larger: ``linear`` hands the product to cuBLAS (``F.linear``); the fused ops keep the
  tensor-core kernel (the decode layer's M is the batch, well below that).

Tile sizes follow from static sizes only (M, N, K, the dtype, the multiprocessor count), so a
captured graph replays the launch it captured.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
import triton

from corelib_cuda.triton_ops import projection as proj
from corelib_cuda.triton_ops.common import (
    FLOAT_DTYPES,
    check,
    check_float,
    dot_precision,
    interpreting,
    next_power_of_2,
    sm_count,
    upcast_in_kernel,
)


@dataclasses.dataclass(frozen=True)
class Tuning:
    gemv_max_m: int = 4  # rows of x up to which the GEMV runs
    gemm_max_m: int = 256  # rows up to which linear runs the tensor-core kernel, not cuBLAS
    gemv_tile_bytes: int = 16384  # weight bytes one GEMV program loads at once
    gemv_programs_per_sm: int = 4  # split rows, then K, until the GEMV has this many programs per SM
    gemm_programs_per_sm: int = 2  # split K until the tensor-core kernel has this many
    gemm_block_k: int = 64


#: the thresholds in use; a benchmark may replace it to sweep them
TUNING = Tuning()


class GemvPlan(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    warps: int


class GemmPlan(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int
    warps: int
    stages: int


def _floor_power_of_2(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


@functools.lru_cache(maxsize=512)
def gemv_plan(n_out: int, k: int, sets: int, itemsize: int, sms: int, tuning: Tuning) -> GemvPlan:
    """Columns and K chunk per GEMV program: about ``gemv_tile_bytes`` of weights each, enough programs."""
    budget = max(16, tuning.gemv_tile_bytes // itemsize)  # weight elements per program
    block_k = min(next_power_of_2(k), max(16, budget // sets))
    block_n = min(16, next_power_of_2(n_out), max(1, _floor_power_of_2(budget // (block_k * sets))))
    wanted = tuning.gemv_programs_per_sm * sms
    while triton.cdiv(n_out, block_n) * triton.cdiv(k, block_k) < wanted:
        if block_n > 1:
            block_n //= 2
        elif block_k > 256:
            block_k //= 2
        else:
            break
    warps = 4 if block_n * block_k * sets <= 4096 else 8
    return GemvPlan(block_n, block_k, triton.cdiv(k, block_k), warps)


@functools.lru_cache(maxsize=512)
def gemm_plan(m: int, n_out: int, k: int, paired: bool, itemsize: int, sms: int, tuning: Tuning) -> GemmPlan:
    """Tiles of the tensor-core kernel; K split in powers of two while the GPU has too few programs."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 32 if paired or itemsize > 2 else 64
    block_k = tuning.gemm_block_k if itemsize <= 2 else 32
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n_out, block_n)
    split = 1
    while tiles * split < tuning.gemm_programs_per_sm * sms and k // (2 * split) >= 4 * block_k:
        split *= 2
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    return GemmPlan(block_m, block_n, block_k, triton.cdiv(k, k_per_split), k_per_split, 4, 3)


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed split-K counters: each launch's last program resets those it used, so one stream reuses them."""
    key = (device, n)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return _COUNTERS[key]


@dataclasses.dataclass
class _Launch:
    """One projection: x [M, K] against w's rows, the epilogue's tensors; unused pointers get x."""

    mode: int
    x: torch.Tensor
    weight: torch.Tensor
    out: torch.Tensor
    n_out: int
    paired: bool = False
    pair_offset: int = 0
    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    bias: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    rope: tuple[Any, ...] = ()  # positions, cos_sin, k_cache, v_cache, slot_mapping
    heads: tuple[int, int, int] = (1, 1, 1)  # NUM_Q, NUM_KV, HALF

    def run(self, pdl: bool) -> torch.Tensor:
        x, w = self.x, self.weight
        m, k = x.shape
        if m == 0 or self.n_out == 0:
            return self.out
        sets = 2 if self.paired else 1
        device = x.device
        sms = sm_count(device)
        positions, cos_sin, k_cache, v_cache, slots = self.rope or (x, x, x, x, x)
        kc_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)) if self.rope else (0, 0, 0)
        vc_strides = (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)) if self.rope else (0, 0, 0)
        residual = self.residual if self.residual is not None else x
        common: list[Any] = [
            self.out, self.out.stride(0), residual, residual.stride(0), self.bias if self.bias is not None else x,
            positions, cos_sin, cos_sin.stride(0) if self.rope else 0, cos_sin.stride(1) if self.rope else 0,
            k_cache, v_cache, slots, *kc_strides, *vc_strides, k_cache.shape[1] if self.rope else 1,
        ]
        num_q, num_kv, half = self.heads
        flags = {"MODE": self.mode, "PAIRED": self.paired, "NORM": self.norm_weight is not None,
                 "HAS_BIAS": self.bias is not None, "NUM_Q": num_q, "NUM_KV": num_kv, "HALF": half, "PDL": pdl,
                 "RNE": interpreting()}
        launch = {"launch_pdl": True} if pdl else {}
        norm_weight = self.norm_weight if self.norm_weight is not None else x
        if m <= TUNING.gemv_max_m:
            plan = gemv_plan(self.n_out, k, sets, w.element_size(), sms, TUNING)
            blocks = triton.cdiv(self.n_out, plan.block_n)
            part, count = self._workspace(plan.split_k, m, blocks)
            proj.gemv_kernel[(blocks, plan.split_k)](
                x, w, norm_weight, part, count, *common,
                m, self.n_out, k, x.stride(0), w.stride(0), self.pair_offset, self.eps,
                SPLIT_K=plan.split_k, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, num_warps=plan.warps,
                **flags, **launch,
            )  # fmt: skip
            return self.out
        g = gemm_plan(m, self.n_out, k, self.paired, w.element_size(), sms, TUNING)
        grid = (triton.cdiv(m, g.block_m), triton.cdiv(self.n_out, g.block_n), g.split_k)
        part, count = self._workspace(g.split_k, m, grid[0] * grid[1])
        proj.gemm_kernel[grid](
            x, w, norm_weight, part, count, *common,
            m, self.n_out, k, x.stride(0), w.stride(0), self.pair_offset, self.eps, g.k_per_split,
            SPLIT_K=g.split_k, BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k,
            UPCAST=upcast_in_kernel(), PRECISION=dot_precision(x.dtype), num_warps=g.warps, num_stages=g.stages,
            **flags, **launch,
        )  # fmt: skip
        return self.out

    def _workspace(self, split: int, m: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        if split == 1:
            return self.x, self.x  # unused
        sets = 2 if self.paired else 1
        part = torch.empty((sets, split, m, self.n_out), dtype=torch.float32, device=self.x.device)
        return part, _counters(self.x.device, blocks)


def _rows(op: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x as [M, K] with a contiguous last dim, checked against weight [N, K]."""
    check_float(op, x=x, weight=weight)
    check(weight.dim() == 2 and x.shape[-1] == weight.shape[1], op,
          f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match (weight [N, K], x [..., K])")
    check(x.dtype == weight.dtype, op, f"x is {x.dtype} and weight {weight.dtype}; they need one dtype")
    check(weight.stride(-1) == 1, op, "the weight needs a contiguous last dim")
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pdl: bool = False
           ) -> torch.Tensor:
    # x [..., K], weight [N, K], bias [N] -> [..., N]
    rows = x.numel() // max(x.shape[-1], 1)
    if rows > TUNING.gemm_max_m or x.dtype not in FLOAT_DTYPES or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    flat = _rows("linear", x, weight)
    n = weight.shape[0]
    out = torch.empty((flat.shape[0], n), dtype=x.dtype, device=x.device)
    _Launch(proj.STORE, flat, weight, out, n, bias=bias).run(pdl)
    return out.view(*x.shape[:-1], n)


def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, *, pdl: bool = False
                    ) -> torch.Tensor:
    # x [M, K], weight [N, K], residual [M, N] -> residual + x @ weight.T
    flat = _rows("linear_residual", x, weight)
    n = weight.shape[0]
    check(residual.shape == (flat.shape[0], n) and residual.dtype == x.dtype, "linear_residual",
          f"residual is {residual.dtype} {tuple(residual.shape)}; expected {x.dtype} {(flat.shape[0], n)}")
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    out = torch.empty((flat.shape[0], n), dtype=x.dtype, device=x.device)
    return _Launch(proj.RESIDUAL, flat, weight, out, n, residual=residual).run(pdl)


def _norm_weight(op: str, h: torch.Tensor, norm_weight: torch.Tensor) -> None:
    check(norm_weight.shape == (h.shape[-1],) and norm_weight.dtype == h.dtype, op,
          f"norm_weight is {norm_weight.dtype} {tuple(norm_weight.shape)}; expected {h.dtype} ({h.shape[-1]},)")


def norm_gate_up_silu_mul(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor,
                          *, pdl: bool = False) -> torch.Tensor:
    # h [M, H], gate_up [2I, H] -> silu(gate) * up [M, I]
    op = "norm_gate_up_silu_mul"
    x = _rows(op, h, gate_up_weight)
    _norm_weight(op, h, norm_weight)
    check(gate_up_weight.shape[0] % 2 == 0, op, f"gate_up has {gate_up_weight.shape[0]} rows; expected 2 I")
    inter = gate_up_weight.shape[0] // 2
    out = torch.empty((x.shape[0], inter), dtype=h.dtype, device=h.device)
    return _Launch(proj.SILU, x, gate_up_weight, out, inter, paired=True, pair_offset=inter, norm_weight=norm_weight,
                   eps=eps).run(pdl)


def norm_logits(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, *, pdl: bool = False
                ) -> torch.Tensor:
    # h [M, H], weight [V, H] -> float32 logits [M, V]
    x = _rows("norm_logits", h, weight)
    _norm_weight("norm_logits", h, norm_weight)
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32, device=h.device)
    return _Launch(proj.LOGITS, x, weight, out, weight.shape[0], norm_weight=norm_weight, eps=eps).run(pdl)


def norm_qkv_rope_kv_write(
    h: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    # h [B, H], qkv [(nh + 2 nkv) hd, H], caches [NB, bs, nkv, hd] -> rotated q [B, nh, hd]
    op = "norm_qkv_rope_kv_write"
    x = _rows(op, h, qkv_weight)
    _norm_weight(op, h, norm_weight)
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype == h.dtype, op,
          f"caches {k_cache.dtype} {tuple(k_cache.shape)} and {v_cache.dtype} {tuple(v_cache.shape)}; expected "
          f"two {h.dtype} [NB, bs, nkv, hd]")
    nkv, hd = k_cache.shape[2], k_cache.shape[3]
    rows = qkv_weight.shape[0]
    check(hd % 2 == 0 and rows % hd == 0 and rows // hd > 2 * nkv, op,
          f"qkv_weight has {rows} rows; expected (nh + 2*{nkv}) * {hd} with nh >= 1 and an even head dim")
    nh = rows // hd - 2 * nkv
    batch = x.shape[0]
    check(positions.shape == (batch,) and slot_mapping.shape == (batch,), op,
          f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)}; expected ({batch},)")
    check(cos_sin.dim() == 3 and cos_sin.shape[1:] == (2, hd) and cos_sin.stride(-1) == 1, op,
          f"cos_sin {tuple(cos_sin.shape)}; expected [max_len, 2, {hd}] with a contiguous last dim")
    check(k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, op, "the caches need a contiguous last dim")
    check(qkv_bias is None or qkv_bias.shape == (rows,), op, f"qkv_bias must be ({rows},)")
    out = torch.empty((batch, nh, hd), dtype=h.dtype, device=h.device)
    return _Launch(proj.ROPE, x, qkv_weight, out.view(batch, nh * hd), rows // 2, paired=True, norm_weight=norm_weight,
                   eps=eps, bias=qkv_bias, rope=(positions, cos_sin, k_cache, v_cache, slot_mapping),
                   heads=(nh, nkv, hd // 2)).run(pdl).view(batch, nh, hd)
