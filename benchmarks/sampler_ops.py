"""The sampler's cost on the device by batch size, each piece captured as a CUDA graph (µs per replay).

    python benchmarks/sampler_ops.py [--vocab 151936] [--batch-sizes 1 8 32 128]

Columns: the whole draw for greedy rows and for rows at temperature 0.7 / top-p 0.9 (``sample_rows``:
the sort of the vocabulary, the cuts, the noise); its sort alone; its noise alone; the plain argmax; the
draw's noise and argmax with no sort (what rows without cuts would need); the argmax of the processed
logits that a step with no drawing row takes (``draws=False``), in the reference and in the cuda
backend's op. Needs a CUDA device (and Triton for the last column).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import torch

from corelib.ops import SamplingInputs
from corelib.ops.sampling import gumbel_noise, sample_rows


def timed(fn: Callable[[], object], replays: int = 50) -> float:
    """µs per replay of ``fn`` captured as a graph (warmed up on a side stream first)."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / replays * 1000


def figures(rows: int, vocab: int) -> list[float]:
    """One row of the table: ``rows`` rows of random logits over ``vocab`` tokens."""
    from corelib_cuda.triton_ops.sampling import sample as triton_sample

    logits = torch.randn(rows, vocab, device="cuda")
    positions = torch.arange(rows, device="cuda") + 100
    greedy = SamplingInputs.of(positions, seeds=list(range(rows)))
    drawn = SamplingInputs.of(positions, seeds=list(range(rows)), temperature=[0.7] * rows, top_p=[0.9] * rows)
    processed = dataclasses.replace(greedy, draws=False)
    ids = torch.arange(vocab, device="cuda")[None, :].expand(rows, vocab)
    return [timed(lambda: sample_rows(logits, greedy)), timed(lambda: sample_rows(logits, drawn)),
            timed(lambda: logits.sort(dim=-1, descending=True)),
            timed(lambda: gumbel_noise(drawn.seeds, positions, ids)), timed(lambda: logits.argmax(dim=-1)),
            timed(lambda: (logits / 0.7 + gumbel_noise(drawn.seeds, positions, ids)).argmax(dim=-1)),
            timed(lambda: sample_rows(logits, processed)), timed(lambda: triton_sample(logits, processed))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    args = parser.parse_args()
    print("rows | draw, greedy rows | draw, t 0.7 p 0.9 | sort | noise | argmax | noise + argmax, no sort"
          " | processed argmax (reference) | processed argmax (cuda op)")
    for rows in args.batch_sizes:
        print(f"{rows} | " + " | ".join(f"{value:.1f}" for value in figures(rows, args.vocab)), flush=True)


if __name__ == "__main__":
    main()
