"""The attention of a captured step with prompt tokens, by tile configuration, against the eager kernels.

One step of ``--decoders`` decode rows (contexts of ``--decode-context``) and one chunk of
``--chunk`` queries at the end of a ``--context``-token prompt, padded to ``--bucket`` tokens and
``--rows`` rows, small-0.6b's heads (16 query, 8 KV, 128 wide), bf16. Each configuration is
checked against the eager kernels' output, then timed with device events over ``--repeats``
calls captured in one graph (the kernel compiled and warm first; the host's launches left out).

    python3 benchmarks/captured_attention.py --out captured.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable

import torch
from corelib_cuda.triton_ops import paged_attention as kernels

from corelib.ops import PagedAttention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decoders", type=int, default=32)
    parser.add_argument("--decode-context", type=int, default=300)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--bucket", type=int, default=576)
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    heads, kv_heads, dim, block = 16, 8, 128, 16
    lengths = [args.decode_context] * args.decoders + [args.context]
    queries = [1] * args.decoders + [args.chunk]
    width = -(-max(lengths) // block) + 1
    blocks = args.rows * width + 1
    k_cache = torch.randn(blocks, block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.zeros(args.rows, width, dtype=torch.int32, device="cuda")
    for row, length in enumerate(lengths):
        tables[row, : -(-length // block)] = torch.arange(1 + row * width, 1 + row * width + -(-length // block))
    seq_lens = torch.tensor(lengths + [1] * (args.rows - len(lengths)), device="cuda")
    ends = list(itertools.accumulate(queries))
    starts = torch.tensor([0, *ends, *[ends[-1]] * (args.rows - len(lengths))], device="cuda")
    q = torch.randn(args.bucket, heads, dim, device="cuda", dtype=torch.bfloat16)
    captured = PagedAttention(tables, seq_lens, block, starts, args.bucket, 0, captured=True)
    total = ends[-1]
    eager = PagedAttention(tables[: len(lengths)], seq_lens[: len(lengths)], block, starts[: len(lengths) + 1],
                           args.chunk, args.decoders)
    scale = dim**-0.5
    expected = kernels.paged_attention(q[:total], k_cache, v_cache, eager, scale)
    results = {"eager (decode kernel + chunk kernel)": timed(
        lambda: kernels.paged_attention(q[:total], k_cache, v_cache, eager, scale), args.repeats)}
    default = kernels.captured_config
    try:
        for block_m, block_n, warps, stages in itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (2, 3)):
            config = kernels.CapturedConfig(block_m, block_m // 2, block_n, dim, warps, stages)
            setattr(kernels, "captured_config", lambda group, head_dim, c=config: c)  # noqa: B010 - a sweep's stand-in
            name = f"captured m{block_m} n{block_n} w{warps} s{stages}"
            try:
                out = kernels.paged_attention(q, k_cache, v_cache, captured, scale)
                error = float((out[:total].float() - expected.float()).abs().max())
                if error > 5e-2 or out[total:].abs().max() != 0:
                    results[name] = float("nan")
                    continue
                results[name] = timed(lambda: kernels.paged_attention(q, k_cache, v_cache, captured, scale),
                                      args.repeats)
            except Exception as failure:  # noqa: BLE001 - a configuration that does not compile is reported
                print(f"{name}: {type(failure).__name__}: {str(failure)[:120]}")
    finally:
        setattr(kernels, "captured_config", default)  # noqa: B010
    for name, us in sorted(results.items(), key=lambda item: item[1]):
        print(f"{name:>44}: {us:8.1f} µs")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Device µs per call of ``fn``: ``repeats`` calls captured in one graph, timed by events around its
    replay (after warm calls), so the host's launch cost does not hide the kernel's."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) * 1e3 / repeats


if __name__ == "__main__":
    main()
