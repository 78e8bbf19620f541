# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False, disallow-untyped-decorators=False
# ruff: noqa: N803 - upper-case compile-time constants
"""Whether a skinny projection through the Hopper's tensor memory accelerator reads weights as cuBLAS does.

At 32-64 rows the decode layer's products go to cuBLAS, because the tensor-core kernel of
``projection.py`` (pointer loads) reads their weights at 39-57 % of the copy rate where cuBLAS
reads at 77-82 %. This measures a bare kernel of the same shape (the weight tile as the MMA's
row side, the rows of x its narrow side; split-K with the last program of a column block summing
the float32 partials) whose tiles come through TMA descriptors, against cuBLAS, the engine's own
choice (``linear``) and the pointer-loading kernel at its default tile and unsplit, at the decode
layer's shapes: no prologue or epilogue, so it is the most such a kernel could gain. Timing as
``projections.py``: a graph of back-to-back calls over weight copies that together exceed the
L2, µs per call, best of five rounds.

    python3 benchmarks/tma_projection.py --models small-0.6b llama-1b --m 32 64 --out tma.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from projections import SHAPES, cublas, ours, timed, weights, with_tuning
from triton.tools.tensor_descriptor import TensorDescriptor

TILES = [(64, 128, 4), (128, 128, 3), (128, 64, 4), (64, 64, 6)]  # (block_n, block_k, stages)
SPLITS = (1, 2, 4, 8)


@triton.jit
def tma_swap_kernel(w_desc, x_desc, out_ptr, part_ptr, count_ptr, M, N, K,
                    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                    SPLIT: tl.constexpr, STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per = tl.cdiv(k_tiles, SPLIT)
    first = pid_s * per
    last = tl.minimum(first + per, k_tiles)
    off_n = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for t in tl.range(first, last, num_stages=STAGES):
        w = w_desc.load([off_n, t * BLOCK_K])  # [BLOCK_N, BLOCK_K]
        x = x_desc.load([0, t * BLOCK_K])  # [BLOCK_M, BLOCK_K], rows past M zero
        acc = tl.dot(w, x.T, acc)
    ns = off_n + tl.arange(0, BLOCK_N)
    ms = tl.arange(0, BLOCK_M)
    mask = (ns[:, None] < N) & (ms[None, :] < M)
    at = ms[None, :] * N + ns[:, None]
    if SPLIT == 1:
        tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + pid_s * M * N + at, acc, mask=mask)
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT - 1:  # the last of its column block: sum the partials in split order
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLIT):
                total += tl.load(part_ptr + s * M * N + at, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(count_ptr + pid_n, 0)


def tma(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, stages: int, split: int,
        ) -> Callable[[], torch.Tensor]:
    """One call of the kernel, its descriptors and buffers made once (as a captured graph would hold them)."""
    m, k = x.shape
    n = w.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    w_desc = TensorDescriptor.from_tensor(w, [block_n, block_k])
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    part = torch.empty(split, m, n, device=x.device, dtype=torch.float32)  # unused unsplit
    count = torch.zeros(triton.cdiv(n, block_n), device=x.device, dtype=torch.int32)
    grid = (triton.cdiv(n, block_n), split)

    def call() -> torch.Tensor:
        tma_swap_kernel[grid](w_desc, x_desc, out, part, count, m, n, k, BLOCK_N=block_n, BLOCK_M=block_m,
                              BLOCK_K=block_k, SPLIT=split, STAGES=stages, num_warps=4)
        return out

    return call


def sweep(models: list[str], ms: list[int], budget: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + budget
    for model in models:
        for name, n, k in SHAPES[model]:
            if name == "lm_head":
                continue
            ws = weights(n, k)
            for m in ms:
                if time.monotonic() > deadline:
                    return rows
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                want = F.linear(x, ws[0]).float()
                row: dict[str, Any] = {"model": model, "shape": name, "m": m, "bytes": n * k * 2,
                                       "cublas_us": timed([cublas(x, w) for w in ws]),
                                       "engine_us": timed([ours(x, w) for w in ws])}
                # the pointer-loading kernel at its default tile, wherever the engine's choice is, and unsplit (as the
                # TMA-fed kernel runs best at K = 1024)
                for key, own in (("pointer_us", ()), ("pointer1_us", ((128, n, k, 128, 4, 1 << 16),))):
                    with_tuning(gemv_max_m=0, gemv_max_m_large=0, gemm_max_m=4096, gemm_max_k=1 << 20,
                                gemm_shape_tiles=own)
                    row[key] = timed([ours(x, w) for w in ws])
                with_tuning()
                for (block_n, block_k, stages), split in itertools.product(TILES, SPLITS):
                    if triton.cdiv(k, block_k) < 2 * split:
                        continue
                    key = f"n{block_n}k{block_k}s{stages}x{split}"
                    try:
                        got = tma(x, ws[0], block_n, block_k, stages, split)().float()
                        err = ((got - want).abs().max() / want.abs().max()).item()
                        if err > 2e-2:
                            row[key] = f"wrong ({err:.3g})"
                            continue
                        row[key + "_us"] = timed([tma(x, w, block_n, block_k, stages, split) for w in ws])
                    except Exception as error:  # noqa: BLE001 - a tile too large for shared memory: no figure
                        row[key] = type(error).__name__
                rows.append(row)
                print(json.dumps(row), flush=True)
            del ws
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["small-0.6b", "llama-1b"])
    parser.add_argument("--m", nargs="+", type=int, default=[32, 64])
    parser.add_argument("--budget-s", type=float, default=150.0, help="wall seconds for the sweep at most")
    parser.add_argument("--out", default="tma.json")
    args = parser.parse_args()
    rows = sweep(args.models, args.m, args.budget_s)
    with open(args.out, "w") as out:
        json.dump(rows, out, indent=2)
    for row in rows:
        timings = {key[:-3]: value for key, value in row.items() if key.endswith("_us")}
        tmas = {key: value for key, value in timings.items() if key not in ("cublas", "engine", "pointer", "pointer1")}
        best = min(tmas, key=tmas.__getitem__) if tmas else "-"
        gbs = {key: row["bytes"] / value / 1e3 for key, value in timings.items()}  # GB/s
        print(f"M={row['m']:<3} {row['model']:>10} {row['shape']:>8}: cuBLAS {row['cublas_us']:.2f} µs"
              f" ({gbs['cublas']:.0f} GB/s), engine {row['engine_us']:.2f} ({gbs['engine']:.0f}),"
              f" pointer {row['pointer_us']:.2f} ({gbs['pointer']:.0f}), unsplit {row['pointer1_us']:.2f},"
              f" best TMA {best}"
              + (f" {tmas[best]:.2f} ({gbs[best]:.0f})" if tmas else ""))


if __name__ == "__main__":
    main()
