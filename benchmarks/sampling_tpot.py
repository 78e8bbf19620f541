"""Decode TPOT by sampling settings at equal batch sizes, in one engine: what a step pays for its sampler.

    python benchmarks/sampling_tpot.py [--backend cuda] [--model small-0.6b]

Greedy (the bench's setting), temperature 1 (OpenAI's default, what the server applies to a request that
sets none), temperature 0.7 with top-p 0.9, Qwen3's generation defaults (temperature 0.6, top-k 20, top-p
0.95), and greedy with a repetition penalty; each batch of 32-token
prompts decodes 96 tokens, EOS ignored, once to warm up and once measured (mean TPOT, in process, async).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from corelib.engine.api import Engine
from corelib.engine.sequence import SamplingParams

CASES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("greedy", {}), ("temperature 1", {"temperature": 1.0}), ("t 0.7, top-p 0.9", {"temperature": 0.7, "top_p": 0.9}),
    ("t 0.6, top-k 20, top-p 0.95", {"temperature": 0.6, "top_k": 20, "top_p": 0.95}),
    ("greedy + repetition 1.1", {"repetition_penalty": 1.1}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--model", default="small-0.6b")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128])
    args = parser.parse_args()
    largest = max(args.batch_sizes)
    with Engine.from_overrides([f"backend={args.backend}", f"model={args.model}", f"engine.max_num_seqs={largest}",
                                "engine.graph_batch_sizes=[1,2,4,8,16,32,64,128]"]) as engine:
        print("rows | " + " | ".join(name for name, _ in CASES) + "  (mean TPOT ms)")
        for rows in args.batch_sizes:
            prompts = [[5 + i % 50, 6, 7, 8] * 8 for i in range(rows)]
            figures = []
            for _, extra in CASES:
                params = [SamplingParams(max_tokens=96, ignore_eos=True, seed=i, **extra) for i in range(rows)]
                engine.generate(prompts, params)
                outputs = engine.generate(prompts, params)
                figures.append(statistics.fmean(o.tpot_ms for o in outputs if o.tpot_ms is not None))
            print(f"{rows} | " + " | ".join(f"{value:.3f}" for value in figures), flush=True)


if __name__ == "__main__":
    main()
