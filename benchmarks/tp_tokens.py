"""Greedy tokens of tensor-parallel engines against tp=1: NCCL and symmetric-memory all-reduces.

Each case decodes the same prompts on tp=1 and on tp=2 (all-reduces through NCCL, then
through symmetric memory) and prints, per engine, how many requests gave tp=1's tokens and
where the first one diverged. float32 should agree exactly; bfloat16 on random weights (logits
a hair apart) may diverge after some tokens, because tp=2 sums the row-parallel layers in
another order: that case reports where, and tp=2 NCCL against tp=2 symmetric memory (the
same sums in the same order) is the comparison that must hold.

    python3 benchmarks/tp_tokens.py --out tokens.json [--cases small-f32 llama-bf16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from typing import Any

from corelib.engine import Engine, SamplingParams

PROMPTS = [[5, 6, 7], list(range(10, 40)), [100] * 5, list(range(200, 216))]
COMMON = ["engine.async_token_handoff=auto", "engine.fused_ops=auto", "engine.max_num_seqs=4",
          "engine.graph_batch_sizes=[4]", "engine.transport=shm"]
# case: (model overrides, new tokens per request)
CASES = {
    "tiny-f32": (["model=tiny", "model.dtype=float32"], 24),
    "small-f32": (["model=small-0.6b", "model.dtype=float32", "model.max_model_len=512"], 24),
    "llama-bf16": (["model=llama-8b", "model.max_model_len=512"], 16),
}
ENGINES = {
    "tp1": ["engine.tp=1"],
    "tp2-nccl": ["engine.tp=2", "engine.fast_allreduce=off"],
    "tp2-symm": ["engine.tp=2", "engine.fast_allreduce=on"],
}


def decode(overrides: list[str], max_tokens: int) -> tuple[list[list[int]], dict[str, Any]]:
    started = time.perf_counter()
    with Engine.from_overrides(overrides) as engine:
        built = time.perf_counter() - started
        outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        info = {"build_s": round(built, 1), "fast_allreduce": engine.options.fast_allreduce,
                "fused_ops": list(engine.options.fused_ops)}
    return [o.output_token_ids for o in outputs], info


def compare(tokens: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    """How many requests match the reference, and the first position where one does not."""
    first = [next((i for i, (a, b) in enumerate(zip(t, r, strict=True)) if a != b), None)
             for t, r in zip(tokens, reference, strict=True)]
    diverged = [i for i in first if i is not None]
    return {"equal": sum(i is None for i in first), "requests": len(first),
            "first_divergence": min(diverged) if diverged else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--backend", default="cuda", help="cuda (native only), or cpu to try this script out")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    backend = [f"backend={args.backend}", *(["backend.runtime=native"] if args.backend == "cuda" else [])]
    report: dict[str, Any] = {}
    failed = False
    for case in args.cases:
        model, max_tokens = CASES[case]
        runs: dict[str, Any] = {}
        tokens: dict[str, list[list[int]]] = {}
        for name, engine in ENGINES.items():
            try:
                tokens[name], runs[name] = decode([*backend, *COMMON, *model, *engine], max_tokens)
            except Exception as error:  # noqa: BLE001 - the other engines still run
                traceback.print_exc()
                runs[name] = {"error": f"{type(error).__name__}: {error}"}
                failed = True
            print(f"{case} {name}: {runs[name]}", flush=True)
        for name in ENGINES:
            if name != "tp1" and name in tokens and "tp1" in tokens:
                runs[name]["vs_tp1"] = compare(tokens[name], tokens["tp1"])
        if "tp2-nccl" in tokens and "tp2-symm" in tokens:
            runs["tp2-symm"]["vs_tp2_nccl"] = compare(tokens["tp2-symm"], tokens["tp2-nccl"])
        report[case] = runs
    print(f"{'case':<12}{'engine':<10}{'equal to tp=1':>15}{'first diff':>12}{'equal to nccl':>15}  fast_allreduce")
    for case, runs in report.items():
        for name, run in runs.items():
            if "error" in run:
                print(f"{case:<12}{name:<10}  error: {run['error'][:90]}")
                continue
            vs = run.get("vs_tp1")
            same = "-" if vs is None else f"{vs['equal']}/{vs['requests']}"
            diff = "-" if vs is None or vs["first_divergence"] is None else str(vs["first_divergence"])
            nccl = run.get("vs_tp2_nccl")
            versus = "-" if nccl is None else f"{nccl['equal']}/{nccl['requests']}"
            gate = "on" if run["fast_allreduce"] else "off"
            print(f"{case:<12}{name:<10}{same:>15}{diff:>12}{versus:>15}  {gate}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
