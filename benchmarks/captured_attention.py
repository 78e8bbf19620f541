"""The attention of a captured step with prompt tokens, by tile configuration, against the eager kernels.

Each scenario (``SCENARIOS``) is one step: decode rows and one chunk of queries at the end of a
prompt, padded to a token bucket and a number of row slots, 16 query and 8 KV heads of
``--head-dims`` (64: the small-0.6b preset; 128: Qwen3-0.6B), bf16. Each configuration (query
tile, key tile, warps, stages, key splits) is checked against the eager
kernels' output, then timed with device events over ``--repeats`` calls captured in one graph
(the kernel compiled and warm first; the host's launches left out). Every graph of a scenario is
timed once per round, the rounds interleaved (``--rounds``), and the median is reported: single
timings of one configuration moved by up to 15 % on an H200.

``--against FILE``: another version of ``corelib_cuda/triton_ops/paged_attention.py`` (an older
commit's, say) whose default tiles are timed beside this one's, as ``against``.

    python3 benchmarks/captured_attention.py --out captured.json
    git show REV:backends/cuda/corelib_cuda/triton_ops/paged_attention.py > /tmp/before.py
    python3 benchmarks/captured_attention.py --against /tmp/before.py --block-m 64 --block-n 64 128 --warps 4
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import statistics
from collections.abc import Callable, Sequence
from types import ModuleType

import torch
from corelib_cuda.triton_ops import paged_attention as kernels

from corelib.ops import PagedAttention

#: name: (decoders, decode context, chunk queries, chunk context, bucket tokens, row slots)
SCENARIOS = {
    "mixed": (32, 300, 512, 1500, 576, 40),  # 32 decode rows beside a 512-token chunk of a 1,500-token prompt
    "mixed-long": (32, 2000, 512, 1500, 576, 40),  # the same beside decoders 2,000 tokens in
    "prompt-500": (0, 0, 500, 500, 512, 8),  # one 500-token prompt
    "prompt-2000": (0, 0, 2000, 2000, 2048, 8),  # one 2,000-token prompt
    "prefix-32": (16, 600, 32, 1056, 128, 24),  # 16 decoders beside 32 new tokens after a cached 1,024-token prefix
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--block-m", type=int, nargs="*", default=[32, 64, 128])
    parser.add_argument("--block-n", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--warps", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="*", default=[2])
    parser.add_argument("--splits", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--head-dims", type=int, nargs="*", default=[64, 128],
                        help="64: the small-0.6b preset's; 128: Qwen3-0.6B's")
    parser.add_argument("--repeats", type=int, default=20, help="calls per graph")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timings of every graph (median)")
    parser.add_argument("--against", default=None, help="another paged_attention.py, its default timed beside")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    against = load_module(args.against) if args.against else None
    results: dict[str, dict[str, float]] = {}
    configs = list(itertools.product(args.block_m, args.block_n, args.warps, args.stages, args.splits))
    columns = [f"{scenario} hd{dim}" for dim in args.head_dims for scenario in args.scenarios]
    for dim in args.head_dims:
        for scenario in args.scenarios:
            column = f"{scenario} hd{dim}"
            results[column] = sweep(SCENARIOS[scenario], dim, configs, args.repeats, args.rounds, against)
            best = sorted(results[column].items(), key=lambda item: item[1])
            print(f"== {column}: " + ", ".join(f"{name} {us:.1f}" for name, us in best[:4]) + " | " +
                  ", ".join(f"{name} {us:.1f}" for name, us in best if name[0] in "deas"))
    names = sorted({name for table in results.values() for name in table})
    print(f"{'configuration':>34} " + " ".join(f"{c:>16}" for c in columns))
    for name in sorted(names, key=lambda n: sum(results[c].get(n, 1e9) for c in columns))[:24]:
        print(f"{name:>34} " + " ".join(f"{results[c].get(name, float('nan')):16.1f}" for c in columns))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)


def load_module(path: str) -> ModuleType:
    """Another version of the kernels' module, loaded beside this one (its imports resolve to this install)."""
    spec = importlib.util.spec_from_file_location("captured_attention_against", path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sweep(scenario: tuple[int, ...], dim: int, configs: Sequence[tuple[int, ...]], repeats: int, rounds: int,
          against: ModuleType | None = None) -> dict[str, float]:
    """µs per call of each configuration on one step (nan: wrong output), the eager kernels, the default and
    ``against``'s default: the median over interleaved rounds."""
    decoders, decode_context, chunk, context, bucket, rows = scenario
    torch.manual_seed(0)
    heads, kv_heads, block = 16, 8, 16
    lengths = [decode_context] * decoders + [context]
    queries = [1] * decoders + [chunk]
    width = -(-max(lengths) // block) + 1
    blocks = rows * width + 1
    k_cache = torch.randn(blocks, block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.zeros(rows, width, dtype=torch.int32, device="cuda")
    for row, length in enumerate(lengths):
        tables[row, : -(-length // block)] = torch.arange(1 + row * width, 1 + row * width + -(-length // block))
    seq_lens = torch.tensor(lengths + [1] * (rows - len(lengths)), device="cuda")
    ends = list(itertools.accumulate(queries))
    starts = torch.tensor([0, *ends, *[ends[-1]] * (rows - len(lengths))], device="cuda")
    q = torch.randn(bucket, heads, dim, device="cuda", dtype=torch.bfloat16)
    captured = PagedAttention(tables, seq_lens, block, starts, bucket, 0, captured=True)
    total = ends[-1]
    eager = PagedAttention(tables[: len(lengths)], seq_lens[: len(lengths)], block, starts[: len(lengths) + 1],
                           chunk, decoders)
    scale = dim**-0.5
    expected = kernels.paged_attention(q[:total], k_cache, v_cache, eager, scale)
    graphs = {"eager (decode kernel + chunk kernel)": captured_graph(
        lambda: kernels.paged_attention(q[:total], k_cache, v_cache, eager, scale), repeats),
        "default": captured_graph(lambda: kernels.paged_attention(q, k_cache, v_cache, captured, scale), repeats)}
    results: dict[str, float] = {}
    if against is not None:
        error = float((against.paged_attention(q, k_cache, v_cache, captured, scale)[:total].float()
                       - expected.float()).abs().max())
        if error > 5e-2:
            results["against"] = float("nan")
        else:
            graphs["against"] = captured_graph(
                lambda: against.paged_attention(q, k_cache, v_cache, captured, scale), repeats)
    if not decoders:  # for scale: torch's flash attention on the same prompt, its keys contiguous (no pages)
        dense_q = torch.randn(1, heads, chunk, dim, device="cuda", dtype=torch.bfloat16)
        dense_k = torch.randn(1, kv_heads, context, dim, device="cuda", dtype=torch.bfloat16)
        dense_v = torch.randn_like(dense_k)
        graphs["sdpa (contiguous keys)"] = captured_graph(lambda: torch.nn.functional.scaled_dot_product_attention(
            dense_q, dense_k, dense_v, is_causal=True, enable_gqa=True), repeats)
    default = kernels.captured_config
    try:
        for block_m, block_n, warps, stages, splits in configs:
            config = kernels.CapturedConfig(block_m, block_m // 2, block_n, dim, warps, stages, splits)
            setattr(kernels, "captured_config", lambda *_, c=config: c)  # noqa: B010 - a sweep's stand-in
            name = f"m{block_m} n{block_n} w{warps} s{stages} k{splits}"
            try:
                out = kernels.paged_attention(q, k_cache, v_cache, captured, scale)
                error = float((out[:total].float() - expected.float()).abs().max())
                if error > 5e-2 or out[total:].abs().max() != 0:
                    results[name] = float("nan")
                    continue
                graphs[name] = captured_graph(
                    lambda: kernels.paged_attention(q, k_cache, v_cache, captured, scale), repeats)
            except Exception as failure:  # noqa: BLE001 - a configuration that does not compile is reported
                print(f"{name}: {type(failure).__name__}: {str(failure)[:120]}")
    finally:
        setattr(kernels, "captured_config", default)  # noqa: B010
    timings: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            timings[name].append(replay_us(graph, repeats))
    return results | {name: statistics.median(values) for name, values in timings.items()}


def captured_graph(fn: Callable[[], object], repeats: int) -> torch.cuda.CUDAGraph:
    """``repeats`` calls of ``fn`` captured in one graph (after warm calls), so the host's launch cost does not
    hide the kernel's. The sweep's stand-in config is read while capturing: the graph keeps its launch."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, repeats: int) -> float:
    """Device µs per call: one replay of the graph, timed by events around it."""
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) * 1e3 / repeats


if __name__ == "__main__":
    main()
