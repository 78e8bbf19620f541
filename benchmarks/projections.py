"""The projection kernels against cuBLAS at decode shapes: where each wins, and the GEMV's tile size.

Every figure is a CUDA graph of back-to-back calls, each over its own copy of the weight (the
copies together several times the L2, so every call reads from memory), replayed; µs per call,
best of five rounds. Sections:

- ``tiles``: M = 1, the GEMV at several weight-tile sizes against cuBLAS (F.linear);
- ``thresholds``: M = 2-256, the GEMV, the tensor-core kernel and cuBLAS;
- ``gemm``: the tensor-core kernel's tile sizes at M = 32 and 128 against cuBLAS;
- ``smallm``: M = 8-64 at every layer shape, the tensor-core kernel with the weight tile as the
  MMA's row side (swap) at several tiles, splits and stages, against cuBLAS (and the GEMV to M = 8);
- ``chain``: dependent GEMVs (y = W x, x = y) alternating 1024->3072 and 3072->1024, with and
  without PDL: what one kernel boundary costs.

    python3 benchmarks/projections.py --sections tiles thresholds chain --out projections.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from corelib_cuda.triton_ops import linear as proj

SHAPES = {  # (name, N, K) of the decode layer's projections
    "small-0.6b": [("qkv", 2048, 1024), ("o", 1024, 1024), ("gate_up", 6144, 1024), ("down", 1024, 3072),
                   ("lm_head", 151936, 1024)],
    "llama-1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192),
                 ("lm_head", 128256, 2048)],
    "llama-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
                 ("lm_head", 128256, 4096)],
}
COLD_BYTES = 400 << 20


def timed(calls: list[Callable[[], object]]) -> float:
    """µs per call of ``calls`` captured in one graph, replayed."""
    for call in calls[:2]:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    best = math.inf
    for _ in range(5):
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / (5 * len(calls)))
    graph.reset()
    return best


def weights(n: int, k: int) -> list[torch.Tensor]:
    copies = max(1, min(64, math.ceil(COLD_BYTES / (n * k * 2))))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]


def with_tuning(**changes: Any) -> proj.Tuning:
    proj.TUNING = dataclasses.replace(DEFAULT, **changes)
    return proj.TUNING


DEFAULT = proj.TUNING


def ours(x: torch.Tensor, w: torch.Tensor) -> Callable[[], object]:
    return lambda: proj.linear(x, w)


def cublas(x: torch.Tensor, w: torch.Tensor) -> Callable[[], object]:
    return lambda: F.linear(x, w)


TILE_VARIANTS = [  # (weight bytes per program, programs per SM)
    (8192, 4), (16384, 4), (32768, 4), (16384, 2), (32768, 2), (65536, 1)]


def tiles(budget: float, models: tuple[str, ...] = ("small-0.6b", "llama-1b", "llama-8b")) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + budget
    for model in models:
        for name, n, k in SHAPES[model]:
            if time.monotonic() > deadline:
                return rows
            ws = weights(n, k)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            floor = n * k * 2 / 4.25e12 * 1e6
            row: dict[str, Any] = {"model": model, "shape": name, "n": n, "k": k, "floor_us": floor,
                                   "cublas_us": timed([cublas(x, w) for w in ws])}
            for tile, per_sm in TILE_VARIANTS:
                with_tuning(gemv_tile_bytes=tile, gemv_programs_per_sm=per_sm)
                row[f"gemv{tile // 1024}k-p{per_sm}_us"] = timed([ours(x, w) for w in ws])
            with_tuning()
            rows.append(row)
            print(json.dumps(row), flush=True)
            del ws
    return rows


def thresholds(budget: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + budget
    cases = [("small-0.6b", "qkv"), ("small-0.6b", "down"), ("llama-1b", "gate_up"), ("llama-1b", "down"),
             ("llama-8b", "qkv")]
    for model, which in cases:
        n, k = next((n, k) for name, n, k in SHAPES[model] if name == which)
        ws = weights(n, k)
        for m in (2, 4, 8, 16, 32, 64, 128, 256):
            if time.monotonic() > deadline:
                return rows
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row: dict[str, Any] = {"model": model, "shape": which, "m": m,
                                   "cublas_us": timed([cublas(x, w) for w in ws])}
            if m <= 16:
                with_tuning(gemv_max_m=1024, gemv_max_m_large=1024, gemv_max_m_tensor_core=1024)
                row["gemv_us"] = timed([ours(x, w) for w in ws])
            with_tuning(gemv_max_m=0, gemv_max_m_large=0, gemm_max_m=4096)
            row["gemm_us"] = timed([ours(x, w) for w in ws])
            with_tuning()
            rows.append(row)
            print(json.dumps(row), flush=True)
        del ws
    return rows


GEMM_VARIANTS = [  # (block_n, block_k, programs per SM)
    (64, 64, 2), (128, 64, 1), (64, 128, 2), (32, 128, 4), (128, 128, 1), (64, 64, 4)]


def gemm_configs(budget: float) -> list[dict[str, Any]]:
    """The tensor-core kernel's tiles at M = 32 and 128 against cuBLAS."""
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + budget
    for model, which in (("small-0.6b", "qkv"), ("small-0.6b", "down"), ("llama-1b", "gate_up"), ("llama-1b", "down")):
        n, k = next((n, k) for name, n, k in SHAPES[model] if name == which)
        ws = weights(n, k)
        for m in (32, 128):
            if time.monotonic() > deadline:
                return rows
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row: dict[str, Any] = {"model": model, "shape": which, "m": m,
                                   "cublas_us": timed([cublas(x, w) for w in ws])}
            for bn, bk, pps in GEMM_VARIANTS:
                with_tuning(gemv_max_m=0, gemv_max_m_large=0, gemm_max_m=4096, gemm_block_n=bn, gemm_block_k=bk,
                            gemm_programs_per_sm=pps)
                row[f"n{bn}k{bk}p{pps}_us"] = timed([ours(x, w) for w in ws])
            with_tuning()
            rows.append(row)
            print(json.dumps(row), flush=True)
        del ws
    return rows


SMALL_M_VARIANTS = [  # (block_n, block_k, programs per SM, min K tiles per split, stages)
    (64, 64, 2, 4, 4), (64, 128, 2, 2, 3), (64, 128, 2, 1, 3), (64, 128, 4, 1, 3), (64, 256, 2, 1, 3),
    (128, 128, 1, 1, 3), (128, 128, 2, 1, 3), (128, 64, 2, 2, 4)]


def small_m(budget: float, models: tuple[str, ...] = ("small-0.6b", "llama-1b", "llama-8b")) -> list[dict[str, Any]]:
    """The swapped tensor-core kernel's variants at M = 8-64 against cuBLAS, every layer shape."""
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + budget
    for model in models:
        for name, n, k in SHAPES[model]:
            if name == "lm_head" and model != "small-0.6b":
                continue
            ws = weights(n, k)
            for m in (8, 16, 32, 64):
                if time.monotonic() > deadline:
                    return rows
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                row: dict[str, Any] = {"model": model, "shape": name, "m": m, "floor_us": n * k * 2 / 4.25e12 * 1e6,
                                       "cublas_us": timed([cublas(x, w) for w in ws])}
                if m <= 8:
                    with_tuning(gemv_max_m=1024, gemv_max_m_large=1024, gemv_max_m_tensor_core=1024)
                    row["gemv_us"] = timed([ours(x, w) for w in ws])
                for bn, bk, pps, tiles_, stages in SMALL_M_VARIANTS:
                    # no entries of the measured table: their own split would override the variant's
                    with_tuning(gemv_max_m=0, gemv_max_m_large=0, gemm_max_m=4096, gemm_block_n=bn, gemm_block_k=bk,
                                gemm_programs_per_sm=pps, gemm_min_k_tiles=tiles_, gemm_stages=stages,
                                gemm_shape_tiles=())
                    try:
                        row[f"n{bn}k{bk}p{pps}t{tiles_}s{stages}_us"] = timed([ours(x, w) for w in ws])
                    except Exception as error:  # noqa: BLE001 - a tile too large for shared memory: no figure
                        row[f"n{bn}k{bk}p{pps}t{tiles_}s{stages}"] = type(error).__name__
                with_tuning()
                rows.append(row)
                print(json.dumps(row), flush=True)
            del ws
    return rows


def chain() -> list[dict[str, Any]]:
    rows = []
    ups = [torch.randn(3072, 1024, device="cuda", dtype=torch.bfloat16) / 32 for _ in range(24)]
    downs = [torch.randn(1024, 3072, device="cuda", dtype=torch.bfloat16) / 55 for _ in range(24)]
    for pdl in (False, True):
        x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)

        def step(pdl: bool = pdl, x: torch.Tensor = x) -> None:
            y = x
            for up, down in zip(ups, downs, strict=True):
                y = proj.linear(proj.linear(y, up, pdl=pdl), down, pdl=pdl)

        us = timed([step]) / (2 * len(ups))
        rows.append({"pdl": pdl, "us_per_gemv": us, "floor_us": 3072 * 1024 * 2 / 4.25e12 * 1e6})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", default=["tiles", "thresholds", "chain"])
    parser.add_argument("--budget-s", type=float, default=90.0, help="wall seconds per sweep section at most")
    parser.add_argument("--out", default="projections.json")
    args = parser.parse_args()
    result: dict[str, Any] = {"tuning": dataclasses.asdict(DEFAULT)}
    if "chain" in args.sections:
        result["chain"] = chain()
    if "tiles" in args.sections:
        result["tiles"] = tiles(args.budget_s)
    if "thresholds" in args.sections:
        result["thresholds"] = thresholds(args.budget_s)
    if "gemm" in args.sections:
        result["gemm"] = gemm_configs(args.budget_s)
    if "smallm" in args.sections:
        result["smallm"] = small_m(args.budget_s)
    with open(args.out, "w") as out:
        json.dump(result, out, indent=2)
    for row in result.get("chain", []):
        print(f"chain pdl={row['pdl']}: {row['us_per_gemv']:.2f} µs per GEMV (floor {row['floor_us']:.2f})")
    for row in result.get("tiles", []):
        cells = " ".join(f"{key[:-3]} {value:.2f}" for key, value in row.items() if key.endswith("_us"))
        print(f"M=1 {row['model']:>10} {row['shape']:>8}: {cells}")
    for row in result.get("thresholds", []) + result.get("gemm", []) + result.get("smallm", []):
        cells = " ".join(f"{key[:-3]} {value:.2f}" for key, value in row.items() if key.endswith("_us"))
        print(f"M={row['m']:<3} {row['model']:>10} {row['shape']:>8}: {cells}")


if __name__ == "__main__":
    main()
