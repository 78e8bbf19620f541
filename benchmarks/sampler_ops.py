"""The sampler's cost on the device by batch size, each piece captured as a CUDA graph (µs per replay).

    python benchmarks/sampler_ops.py [--vocab 151936] [--batch-sizes 1 8 32 128]

Columns: the whole draw (``sample_rows``) for greedy rows; for rows at temperature 1 without cuts (the noise
and an argmax, nothing sorted), in the reference and in the cuda backend's op; for rows at temperature 0.7 /
top-p 0.9 (the sort of the vocabulary, the cuts, the noise), in both; the sort alone; the plain argmax; the
argmax of the processed logits that a step with no drawing row takes (``draws=False``), in both. Then how
many rows the cuda op's draw gives another token than the reference's, with and without cuts. Needs a CUDA
device and Triton.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import torch

from corelib.ops import SamplingInputs
from corelib.ops.sampling import sample_rows


def timed(fn: Callable[[], object], replays: int = 50) -> float:
    """µs per replay of ``fn`` captured as a graph (warmed up on a side stream first)."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())  # fn's inputs were made on the current stream
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
    uncut = dataclasses.replace(SamplingInputs.of(positions, seeds=list(range(rows)), temperature=[1.0] * rows),
                                cuts=False)
    cut = SamplingInputs.of(positions, seeds=list(range(rows)), temperature=[0.7] * rows, top_p=[0.9] * rows)
    processed = dataclasses.replace(greedy, draws=False)
    return [timed(lambda: sample_rows(logits, greedy)),
            timed(lambda: sample_rows(logits, uncut)), timed(lambda: triton_sample(logits, uncut)),
            timed(lambda: sample_rows(logits, cut)), timed(lambda: triton_sample(logits, cut)),
            timed(lambda: logits.sort(dim=-1, descending=True, stable=True)), timed(lambda: logits.argmax(dim=-1)),
            timed(lambda: sample_rows(logits, processed)), timed(lambda: triton_sample(logits, processed))]


def mismatches(rows: int, vocab: int, steps: int) -> tuple[int, int]:
    """Rows where the cuda op's draw differs from the reference's over ``steps`` draws of ``rows`` rows of
    bfloat16-valued logits (ties), without cuts and with top-k, top-p and min_p: (without, with)."""
    from corelib_cuda.triton_ops.sampling import sample as triton_sample

    found = [0, 0]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for step in range(steps):
        logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 4).to(torch.bfloat16).float()
        positions = torch.arange(rows, device="cuda") + step
        temperature = torch.rand(rows, device="cuda", generator=gen) * 1.5
        free = dataclasses.replace(SamplingInputs.of(positions, seeds=list(range(rows)), temperature=temperature),
                                   cuts=False)
        cuts = SamplingInputs.of(positions, seeds=list(range(rows)), temperature=temperature,
                                 top_k=[(0, 20, 50, 0)[i % 4] for i in range(rows)],
                                 top_p=[(0.95, 1.0, 0.8, 0.9)[i % 4] for i in range(rows)],
                                 min_p=[(0.0, 0.05, 0.0, 0.1)[i % 4] for i in range(rows)])
        for k, sampling in enumerate((free, cuts)):
            found[k] += int((triton_sample(logits, sampling) != sample_rows(logits, sampling)).sum())
    return found[0], found[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--check-steps", type=int, default=50, help="draws of 128 rows compared with the reference")
    args = parser.parse_args()
    print("rows | draw, greedy rows (reference) | draw, t 1, no cuts (reference) | the same (cuda op)"
          " | draw, t 0.7 p 0.9 (reference) | the same (cuda op) | sort | argmax"
          " | processed argmax (reference) | processed argmax (cuda op)")
    for rows in args.batch_sizes:
        print(f"{rows} | " + " | ".join(f"{value:.1f}" for value in figures(rows, args.vocab)), flush=True)
    free, cuts = mismatches(128, args.vocab, args.check_steps)
    print(f"cuda op against the reference, {args.check_steps} draws x 128 rows: {free} rows differ without cuts, "
          f"{cuts} with cuts", flush=True)


if __name__ == "__main__":
    main()
