"""``linear`` and ``linear_residual`` over ``projection``'s kernels, and the choice of kernel by M.

Which kernel runs is chosen by the rows of x (M), K and the weight's size, with thresholds
measured on an H200 (``Tuning``; benchmarks/projections.py sweeps the kernels alone, and the
decode step replayed as a graph, per model and batch size, chose between what it left):

- the GEMV (float32 accumulation on CUDA cores, its weight tile loaded before the PDL wait) up
  to ``gemv_max_m`` rows, ``gemv_max_m_large`` for weights over ``gemv_small_bytes``: past
  that, every extra row costs it more than cuBLAS takes for the whole product. Its tiles of
  32 KB, two programs per multiprocessor wanted, took 2.5 % (small-0.6b), 3.6 % (1 B) and 16 %
  (8 B; its down projection no longer splits K) off a bs-1 step against 16 KB and four; from
  two rows the large weights went faster through cuBLAS (bs 2: 4 %, 14 %, 27 % off the step), and
  from three rows llama-1b's qkv and o (K = 2048, 8-13 MB) did too (bs 4: 6 % off the engine's TPOT).
  Where the tensor-core kernel takes the product (K <= ``gemm_max_k``) the GEMV runs only up to
  ``gemv_max_m_tensor_core`` rows (2: from 3 rows that kernel is faster);
- the tensor-core kernel (split over K; up to 64 rows the weight tile is the MMA's row side) past
  the GEMV up to ``gemm_max_m`` rows where K is at most ``gemm_max_k``. Alone it loses to cuBLAS
  at nearly every decode shape (M = 8-256, 0.6-8 B); in the step, its fused norm and epilogues
  save the norm, RoPE and SiLU kernels cuBLAS needs beside it. Measured as the step's device time
  (benchmarks/projection_tuning.py), small-0.6b (K = 1024, but 3072 for down) took 8-16 % less at
  6-16 rows with it for K <= 1024 (the down projection through it cost more than it saved at 6
  and 12 rows); the 1 B shape (K = 2048) gained nothing at 6-16 rows, and both models lost
  11-62 % at 32-64 rows;
- the tensor-core kernel also, past the GEMV up to a row count of their own, for the product shapes
  ``gemm_shape_tiles`` names, past ``gemm_max_m`` rows with their own K tile and pipeline depth, and at every
  row with their own split of K (``GEMM_SHAPE_TILES``: small-0.6b's four decoder-layer products up to 32 rows;
  its down projection, K = 3072, from the GEMV's last row on: its TPOT took 9.7 % less at bs 8 and 9.1 % at bs 16
  than with cuBLAS's product and split-K reduction, H100, BENCHMARKS.md 2026-12-06, the down projection from 5 rows;
  llama-1b's gate_up and down from 2 rows to 64, split no finer than 16 K tiles a program);
- cuBLAS otherwise (``F.linear``; ``linear_residual``: ``addmm_`` on the residual, added in its epilogue).

The tensor-core kernel's tiles were measured on Hopper (227 KB of shared memory a multiprocessor); where one
overflows a smaller GPU's, Triton refuses it at its first launch and that product takes ``gemm_fallback_tile``
(64-wide K tiles, 3 stages: about a quarter of it) from then on.

Tile sizes follow from static sizes only (M, N, K, the dtype, the multiprocessor count), so a
captured graph replays the launch it captured.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
import triton

try:
    from triton.tools.tensor_descriptor import TensorDescriptor

    HOST_DESCRIPTORS = True
except ImportError:  # Triton before 3.3 (the extra allows 3.2): no host-side descriptors, so no gemm_tma
    HOST_DESCRIPTORS = False

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

#: The GEMV's tile and programs per multiprocessor by product shape, where they differ from ``Tuning``'s:
#: (M, N, K, sets, tile bytes, programs per SM). Chosen one shape at a time in the whole decode step
#: replayed as a graph (benchmarks/gemv_tiles.py, H200, bf16, two alternating rounds, kept where the step
#: gained more than 0.2 %); all together, small-0.6b's step took 4.3 % less at bs 1 and 1.3 % at bs 2,
#: llama-1b's 2.8 % and 0.4 %, llama-8b's 1.4 % at bs 1 (its larger weights leave the GEMV from two rows).
#: In the engine (TPOT): small-0.6b bs 2 -5.5 %, bs 1 unchanged; llama-1b bs 1 -1.0 %; llama-8b bs 1 -0.8 %.
#: Where K is long (the down projections) larger tiles pay; where the weight is small, smaller ones.
GEMV_SHAPE_TILES: tuple[tuple[int, int, int, int, int, int], ...] = (
    (1, 3072, 1024, 2, 16384, 2),  # small-0.6b gate_up
    (1, 1024, 3072, 1, 65536, 4),  # small-0.6b down
    (1, 151936, 1024, 1, 8192, 2),  # small-0.6b LM head
    (2, 1024, 1024, 2, 8192, 2),  # small-0.6b qkv
    (2, 3072, 1024, 2, 8192, 2),  # small-0.6b gate_up
    (1, 1536, 2048, 2, 16384, 4),  # llama-1b qkv
    (1, 2048, 2048, 1, 8192, 2),  # llama-1b o
    (1, 2048, 8192, 1, 65536, 2),  # llama-1b down
    (2, 2048, 2048, 1, 16384, 4),  # llama-1b o
    (1, 4096, 14336, 1, 65536, 4),  # llama-8b down
)

#: Products the tensor-core kernel takes wherever the GEMV does not, up to a row count, its tile past
#: ``Tuning.gemm_max_m`` rows and how far it splits K: (rows of x up to, weight rows N, K, K tile, pipeline stages, K
#: tiles each split keeps at least), for 2-byte weights.
#: small-0.6b's four decoder-layer products at up to 32 rows, 128-wide K tiles and 4 stages: its fused norms, RoPE and
#: SiLU leave 5 kernels a layer where cuBLAS needs 9, and the engine's TPOT at bs 32 took 4.8 % less (H100, three
#: alternations; BENCHMARKS.md, 2026-12-06, the tensor-core kernel at 32 rows); its down projection (K = 3072, past
#: ``gemm_max_k``) from the GEMV's last row on too, where cuBLAS ran it with a split-K reduction (bs 8 and 16: 9-10 %
#: less TPOT).
#: llama-1b's gate_up and down (K = 2048 and 8192) from 2 rows to 64, each split keeping 16 K tiles: the SiLU kernel
#: and cuBLAS's split-K reduction go (6 kernels a layer where cuBLAS needs 8), and the graph-replayed step took 3-4 %
#: less at 2-32 rows, the same at 64 (H100, BENCHMARKS.md 2026-12-06, late night). Split down to 4 K tiles a program
#: as the others are, the same two lost 4-10 % (512 programs of a pipeline that is all fill, down's partials a quarter
#: of its weight's bytes); llama-1b's qkv and o stay with cuBLAS (its qkv through this kernel took 12.3 µs against 7.6,
#: o 7.8 against 6.3), so do small-0.6b's LM head (through this kernel the bs-32 TPOT gained nothing) and small-0.6b's
#: products at 64 rows (15 % longer), H100, BENCHMARKS.md 2026-12-06, night.
#: small-0.6b's K = 1024 products unsplit (8 K tiles a program, all of K): the engine's TPOT took 1.4 % less at bs 16
#: and 2.6 % at bs 32 than split to 4 K tiles, the same at bs 1-8 (H100, BENCHMARKS.md 2026-12-07, late); a bare kernel
#: so unsplit took gate_up at 32 rows in 7.56 µs against 11.18 split in two.
GEMM_SHAPE_TILES: tuple[tuple[int, int, int, int, int, int], ...] = (
    (32, 2048, 1024, 128, 4, 8),  # small-0.6b qkv (RoPE, KV cache write)
    (32, 1024, 1024, 128, 4, 8),  # small-0.6b o (+ residual)
    (32, 6144, 1024, 128, 4, 8),  # small-0.6b gate_up (SiLU-mul)
    (32, 1024, 3072, 128, 4, 4),  # small-0.6b down (+ residual)
    (64, 16384, 2048, 128, 4, 16),  # llama-1b gate_up (SiLU-mul)
    (64, 2048, 8192, 128, 4, 16),  # llama-1b down (+ residual)
)


@dataclasses.dataclass(frozen=True)
class Tuning:
    #: rows of x up to which the GEMV runs (weights up to gemv_small_bytes): llama-1b's engine TPOT took 6.3 % less at
    #: bs 4 and 1.1 % at bs 3 with its qkv and o on cuBLAS from 3 rows than on the GEMV to 4, the same at bs 2 (1 row:
    #: 3.8 % more at bs 2), H100, BENCHMARKS.md 2026-12-07
    gemv_max_m: int = 2
    gemv_max_m_large: int = 1  # the same for larger weights
    #: the same where the tensor-core kernel takes the product (K <= gemm_max_k): small-0.6b's engine TPOT at bs 4 took
    #: 20 % less with its qkv, o and gate_up there than on the GEMV, at bs 2 20 % more (H100, BENCHMARKS.md 2026-12-06).
    #: As many rows as gemv_max_m now, a bound of its own all the same: a sweep of gemv_max_m leaves these at theirs
    gemv_max_m_tensor_core: int = 2
    gemv_small_bytes: int = 16 << 20
    gemm_min_m: int = 1  # rows from which the tensor-core kernel runs, where the GEMV does not ...
    gemm_max_m: int = 16  # ... up to these ...
    gemm_max_k: int = 1024  # ... where K is at most this (the module docstring says why)
    gemv_tile_bytes: int = 32768  # weight bytes one GEMV program loads at once
    gemv_programs_per_sm: int = 2  # split rows, then K, until the GEMV has this many programs per SM
    #: (M, N, K, sets, tile bytes, programs per SM): the two above for one product's shape (sets 2: the
    #: kernel's paired rows), as benchmarks/gemv_tiles.py measured them in the step
    gemv_shape_tiles: tuple[tuple[int, int, int, int, int, int], ...] = GEMV_SHAPE_TILES
    gemv_early_epilogue_loads: bool = True  # the epilogue's residual, cos/sin and slots read before the reduction
    gemm_programs_per_sm: int = 2  # split K until the tensor-core kernel has this many
    gemm_block_n: int = 64
    #: the same for each half of a paired product's tile, with the weight as the MMA's rows: at 32 small-0.6b's step
    #: took 1.5-1.9x as long at bs 16-32 (H100, BENCHMARKS.md 2026-12-07, late)
    gemm_paired_block_n: int = 64
    #: paired products' halves stacked in one tile of ``gemm_paired_block_n`` weight rows (half a's, half b's: one
    #: MMA, half the columns a program, twice the programs), with the weight as the MMA's rows and pointer loads,
    #: where the doubled grid still fits one wave of the GPU. small-0.6b's TPOT took 7.6 %, 6.2 % and 6.6 % less at
    #: bs 8, 16 and 32 (its gate_up: 96 programs for 48; the step's tensor-core kernels 18.9 -> 14.6 µs each at
    #: bs 32); llama-1b's gate_up (128 programs, 256 stacked) took 2 % longer at bs 8-16 stacked, and is not
    #: (H100, BENCHMARKS.md 2026-12-07, last)
    gemm_paired_stacked: bool = True
    #: the K tile and pipeline depth of 2-byte weights: 128 and 5 took small-0.6b's TPOT 2 % down at bs 8 and 3 % at
    #: bs 16 against 64 and 3 (H100, BENCHMARKS.md 2026-12-06); a GPU whose shared memory they overflow gets
    #: ``gemm_fallback_tile``
    gemm_block_k: int = 128
    gemm_stages: int = 5
    gemm_fallback_tile: tuple[int, int] = (64, 3)  # (K tile, stages) where a tile does not fit the shared memory
    gemm_warps: int = 4
    #: (rows up to, weight rows N, K, K tile, stages, K tiles a split keeps): product shapes the tensor-core kernel
    #: takes up to their rows, with their own tile past ``gemm_max_m`` rows and their own split (2-byte weights)
    gemm_shape_tiles: tuple[tuple[int, int, int, int, int, int], ...] = GEMM_SHAPE_TILES
    gemm_min_k_tiles: int = 4  # K tiles each split keeps at least (a product gemm_shape_tiles names: its own)
    gemm_swap: bool = True  # weight rows as the MMA's row side (up to 64 rows of x)
    #: the tensor-core kernel's weight tiles through TMA descriptors (compute capability 9.0 on; not ROPE's rows, and
    #: only where each split's K range is whole K tiles). A bare kernel so fed read small-0.6b's K = 1024 weights,
    #: unsplit, about as fast as cuBLAS at 32 and 64 rows (H100, BENCHMARKS.md 2026-12-07, evening); off: in the step
    #: small-0.6b's TPOT at bs 32 was 1.8 % longer with it than with pointer loads, llama-1b's 0-0.9 % at bs 1-64
    #: (H100, BENCHMARKS.md 2026-12-07, late)
    gemm_tma: bool = False
    gemm_float_logits: bool = True  # the LM head's cuBLAS product written as float32 (no widening kernel after it)
    #: rows up to which, beside a cuBLAS qkv product in a decode step, the attention kernel rotates q and k and writes
    #: the step's keys itself (no RoPE kernel): llama-1b's step took 1.5-2.2 % less at 8-64 rows and small-0.6b's 2.9 %
    #: at 64; at 128 rows, where each of its programs holds the newest key, it was 0.1-0.9 % slower in the step and
    #: 2.3 % in the engine (H100, BENCHMARKS.md 2026-12-06, the RoPE inside the attention)
    rope_in_attention_max_m: int = 64


class Kernel(enum.Enum):
    GEMV = "gemv"
    GEMM = "gemm"
    CUBLAS = "cublas"


def kernel_for(m: int, n: int, k: int, itemsize: int) -> Kernel:
    """Which kernel computes an [m, k] x [n, k]' product (``TUNING``'s thresholds)."""
    tuning = TUNING
    gemv_rows = tuning.gemv_max_m if n * k * itemsize <= tuning.gemv_small_bytes else tuning.gemv_max_m_large
    if k <= tuning.gemm_max_k:
        gemv_rows = min(gemv_rows, tuning.gemv_max_m_tensor_core)
    if m <= gemv_rows:
        return Kernel.GEMV
    if tuning.gemm_min_m <= m <= tuning.gemm_max_m and k <= tuning.gemm_max_k:
        return Kernel.GEMM
    if _listed(m, n, k, itemsize, tuning) is not None:
        return Kernel.GEMM
    return Kernel.CUBLAS


class ShapeTile(NamedTuple):
    """What ``gemm_shape_tiles`` measured for one product shape."""

    block_k: int
    stages: int
    min_k_tiles: int  # K tiles each split keeps at least


def _listed(m: int, n: int, k: int, itemsize: int, tuning: Tuning) -> ShapeTile | None:
    """The entry of ``gemm_shape_tiles`` for an [m, k] x [n, k]' product of up to its rows (n: the weight's rows,
    both halves of a paired product); None where it names no such product."""
    if itemsize != 2:
        return None
    for max_m, shape_n, shape_k, block_k, stages, min_k_tiles in tuning.gemm_shape_tiles:
        if m <= max_m and (shape_n, shape_k) == (n, k):
            return ShapeTile(block_k, stages, min_k_tiles)
    return None


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
    swap: bool
    stacked: bool = False  # a paired product's halves in one tile of 2 * block_n weight rows


def _floor_power_of_2(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


@functools.lru_cache(maxsize=512)
def gemv_plan(m: int, n_out: int, k: int, sets: int, itemsize: int, sms: int, tuning: Tuning) -> GemvPlan:
    """Columns and K chunk per GEMV program: about ``gemv_tile_bytes`` of weights each, enough programs
    (``gemv_shape_tiles`` gives both for the shapes measured one by one)."""
    tile_bytes, per_sm = tuning.gemv_tile_bytes, tuning.gemv_programs_per_sm
    for shape_m, shape_n, shape_k, shape_sets, shape_tile, shape_per_sm in tuning.gemv_shape_tiles:
        if (shape_m, shape_n, shape_k, shape_sets) == (m, n_out, k, sets):
            tile_bytes, per_sm = shape_tile, shape_per_sm
    budget = max(16, tile_bytes // itemsize)  # weight elements per program
    block_k = min(next_power_of_2(k), max(16, budget // sets))
    block_n = min(16, next_power_of_2(n_out), max(1, _floor_power_of_2(budget // (block_k * sets))))
    wanted = per_sm * sms
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
    """Tiles of the tensor-core kernel; K split in powers of two while the GPU has too few programs.

    With ``swap`` (and at most 64 rows) the weight tile is the MMA's row side and the rows of x,
    padded to 16, its narrow side: one read of each weight tile serves every row.
    """
    swap = tuning.gemm_swap and m <= 64
    stacked = False
    if swap:
        block_m = max(16, next_power_of_2(m))
        block_n = tuning.gemm_paired_block_n if paired else tuning.gemm_block_n
        if paired and tuning.gemm_paired_stacked and triton.cdiv(m, block_m) * triton.cdiv(n_out, block_n // 2) <= sms:
            stacked, block_n = True, block_n // 2  # twice the programs, still one wave
    else:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        block_n = tuning.gemm_block_n // 2 if paired or itemsize > 2 else tuning.gemm_block_n
    block_k = tuning.gemm_block_k if itemsize <= 2 else 32
    stages = tuning.gemm_stages if itemsize <= 2 else 2
    # A named product keeps its own split at every row it covers, and its own tile past gemm_max_m rows (up to
    # them, the general tile).
    measured = _listed(m, n_out * (2 if paired else 1), k, itemsize, tuning)
    if measured is not None and m > tuning.gemm_max_m:
        block_k, stages = measured.block_k, measured.stages
    min_k_tiles = tuning.gemm_min_k_tiles if measured is None else measured.min_k_tiles
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n_out, block_n)
    split = 1
    while (tiles * split < tuning.gemm_programs_per_sm * sms
           and k // (2 * split) >= min_k_tiles * block_k):
        split *= 2
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    return GemmPlan(block_m, block_n, block_k, triton.cdiv(k, k_per_split), k_per_split, tuning.gemm_warps, stages,
                    swap, stacked)


@functools.lru_cache(maxsize=8)
def _fitting(tuning: Tuning) -> Tuning:
    """``tuning`` with the fallback tile for every product: for a GPU whose shared memory a measured tile overflows."""
    block_k, stages = tuning.gemm_fallback_tile
    return dataclasses.replace(tuning, gemm_block_k=block_k, gemm_stages=stages, gemm_shape_tiles=())


#: (device index, M, N, K, paired) of the products whose tile overflowed the GPU's shared memory: they take the
#: fallback tile from then on, without compiling the larger one again
_TOO_LARGE: set[tuple[int, int, int, int, bool]] = set()

_COUNTERS: dict[tuple[torch.device, int, int], torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed split-K counters of the current stream: each launch's last program resets those it used, so the
    launches of one stream reuse them, one after another; two streams (two engines of one process) running at
    once get their own, or one launch's programs would count into the other's. Traced by ``torch.compile``
    (``engine.compile``), the stream is left out: the compiled layer keeps the counters it was traced with."""
    stream = 0
    if device.type == "cuda" and not torch.compiler.is_compiling():
        stream = torch.cuda.current_stream(device).cuda_stream
    key = (device, n, stream)
    counters = _COUNTERS.get(key)
    if counters is None:
        counters = _COUNTERS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return counters


@dataclasses.dataclass
class Projection:
    """One launch of a projection kernel: x [M, K] against w's rows, the epilogue's tensors (unused: x)."""

    mode: int
    x: torch.Tensor
    weight: torch.Tensor
    out: torch.Tensor
    n_out: int
    paired: bool = False
    pair_offset: int = 0
    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    unit_norm: bool = False  # the rows normalized with a unit weight (the norm's is folded into ``weight``)
    bias: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    rope: tuple[Any, ...] = ()  # positions, cos_sin, k_cache, v_cache, slot_mapping
    heads: tuple[int, int, int] = (1, 1, 1)  # NUM_Q, NUM_KV, HALF

    def run(self, kernel: Kernel, pdl: bool) -> torch.Tensor:
        """Launch ``kernel`` (GEMV or GEMM); cuBLAS is the caller's business."""
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
        flags = {"MODE": self.mode, "PAIRED": self.paired, "NORM": self.norm_weight is not None or self.unit_norm,
                 "NORM_WEIGHT": self.norm_weight is not None, "HAS_BIAS": self.bias is not None, "NUM_Q": num_q,
                 "NUM_KV": num_kv, "HALF": half, "PDL": pdl, "RNE": interpreting()}
        launch = {"launch_pdl": True} if pdl else {}
        norm_weight = self.norm_weight if self.norm_weight is not None else x
        if kernel is Kernel.GEMV:
            plan = gemv_plan(m, self.n_out, k, sets, w.element_size(), sms, TUNING)
            blocks = triton.cdiv(self.n_out, plan.block_n)
            part, count = self._workspace(plan.split_k, m, blocks)
            proj.gemv_kernel[(blocks, plan.split_k)](
                x, w, norm_weight, part, count, *common,
                m, self.n_out, k, x.stride(0), w.stride(0), self.pair_offset, self.eps,
                SPLIT_K=plan.split_k, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, num_warps=plan.warps,
                EARLY=TUNING.gemv_early_epilogue_loads, **flags, **launch,
            )  # fmt: skip
            return self.out
        key = (device.index or 0, m, self.n_out, k, self.paired)
        tuning = _fitting(TUNING) if key in _TOO_LARGE else TUNING
        try:
            return self._gemm(gemm_plan(m, self.n_out, k, self.paired, w.element_size(), sms, tuning), common, flags,
                              launch, norm_weight)
        except triton.runtime.errors.OutOfResources:
            if tuning is not TUNING or _fitting(TUNING) == TUNING:
                raise
            _TOO_LARGE.add(key)  # a smaller GPU than the tile was measured on: the fallback tile, from now on
            return self._gemm(gemm_plan(m, self.n_out, k, self.paired, w.element_size(), sms, _fitting(TUNING)),
                              common, flags, launch, norm_weight)

    def _gemm(self, g: GemmPlan, common: list[Any], flags: dict[str, Any], launch: dict[str, Any],
              norm_weight: torch.Tensor) -> torch.Tensor:
        """Launch the tensor-core kernel with plan ``g``."""
        x, w = self.x, self.weight
        m, k = x.shape
        device = x.device
        grid = (triton.cdiv(m, g.block_m), triton.cdiv(self.n_out, g.block_n), g.split_k)
        part, count = self._workspace(g.split_k, m, grid[0] * grid[1])
        stats = x  # unused without a norm or a split
        if flags["NORM"] and g.split_k > 1:  # each split's squares of the rows, [blocks, split, M]
            stats = torch.empty((grid[0] * grid[1], g.split_k, m), dtype=torch.float32, device=device)
        tma = self._tma(g)
        # a descriptor per launch (a graph keeps the one it captured)
        weight: Any = TensorDescriptor.from_tensor(w, [g.block_n, g.block_k]) if tma else w
        proj.gemm_kernel[grid](
            x, weight, norm_weight, part, count, stats, *common,
            m, self.n_out, k, x.stride(0), w.stride(0), self.pair_offset, self.eps, g.k_per_split,
            SPLIT_K=g.split_k, BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k,
            UPCAST=upcast_in_kernel(), PRECISION=dot_precision(x.dtype), SWAP=g.swap, TMA=tma, STACKED=g.stacked,
            num_warps=g.warps,
            num_stages=g.stages,
            **flags, **launch,
        )  # fmt: skip
        return self.out

    def _tma(self, g: GemmPlan) -> bool:
        """Whether plan ``g`` reads the weight through a TMA descriptor (``Tuning.gemm_tma``): 2-byte contiguous
        weights, whole K tiles a split (or one split), rows in one run (not ROPE's pairs nor stacked halves), a GPU
        with TMA, not under torch.compile."""
        w = self.weight
        if not (TUNING.gemm_tma and HOST_DESCRIPTORS and self.mode != proj.ROPE and w.element_size() == 2
                and w.is_contiguous() and not g.stacked):
            return False
        if (g.split_k > 1 and g.k_per_split % g.block_k) or (w.shape[1] * w.element_size()) % 16 or w.data_ptr() % 16:
            return False
        if interpreting():
            return True
        return (w.device.type == "cuda" and torch.cuda.get_device_capability(w.device)[0] >= 9
                and not torch.compiler.is_compiling())

    def _workspace(self, split: int, m: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        if split == 1:
            return self.x, self.x  # unused
        sets = 2 if self.paired else 1
        part = torch.empty((sets, split, m, self.n_out), dtype=torch.float32, device=self.x.device)
        return part, _counters(self.x.device, blocks)


def rows_of(op: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
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
    if x.dtype not in FLOAT_DTYPES or x.dtype != weight.dtype or weight.dim() != 2:
        return F.linear(x, weight, bias)
    kernel = kernel_for(rows, weight.shape[0], weight.shape[1], weight.element_size())
    if kernel is Kernel.CUBLAS:
        return F.linear(x, weight, bias)
    flat = rows_of("linear", x, weight)
    n = weight.shape[0]
    out = torch.empty((flat.shape[0], n), dtype=x.dtype, device=x.device)
    Projection(proj.STORE, flat, weight, out, n, bias=bias).run(kernel, pdl)
    return out.view(*x.shape[:-1], n)


def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, *, pdl: bool = False
                    ) -> torch.Tensor:
    # x [M, K], weight [N, K], residual [M, N] -> residual + x @ weight.T
    flat = rows_of("linear_residual", x, weight)
    n = weight.shape[0]
    check(residual.shape == (flat.shape[0], n) and residual.dtype == x.dtype, "linear_residual",
          f"residual is {residual.dtype} {tuple(residual.shape)}; expected {x.dtype} {(flat.shape[0], n)}")
    kernel = kernel_for(flat.shape[0], n, flat.shape[1], weight.element_size())
    if kernel is Kernel.CUBLAS:  # the residual added in cuBLAS's epilogue, in place: addmm would copy it first
        if residual.is_contiguous():
            return residual.addmm_(flat, weight.t())
        return torch.addmm(residual, flat, weight.t())
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    out = torch.empty((flat.shape[0], n), dtype=x.dtype, device=x.device)
    return Projection(proj.RESIDUAL, flat, weight, out, n, residual=residual).run(kernel, pdl)
