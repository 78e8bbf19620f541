"""Where the host's time goes in a decode step: cProfile over steady decode steps of one engine.

    python3 benchmarks/profile_step.py model=small-0.6b backend=cuda --batch 32 --prompt 1900
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from corelib.engine import Engine, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=1900)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--top", type=int, default=22)
    args = parser.parse_args()
    overrides = [*args.overrides, f"engine.max_num_seqs={args.batch}",
                 f"engine.max_num_batched_tokens={args.batch * args.prompt}",
                 f"engine.graph_batch_sizes=[{args.batch}]"]
    with Engine.from_overrides(overrides) as engine:
        vocab = engine.vocab_size
        for i in range(args.batch):
            prompt = [(i * 131 + j * 17) % (vocab - 2) + 2 for j in range(args.prompt)]
            engine.add_request(prompt, SamplingParams(max_tokens=args.steps + 10, ignore_eos=True))
        for _ in range(6):
            engine.step()
        profiler = cProfile.Profile()
        start = time.perf_counter()
        profiler.enable()
        for _ in range(args.steps):
            engine.step()
        profiler.disable()
        wall = (time.perf_counter() - start) / args.steps
        print(f"{wall * 1e3:.3f} ms per engine step (host wall), batch {args.batch}, prompt {args.prompt}")
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumtime").print_stats(args.top)


if __name__ == "__main__":
    main()
