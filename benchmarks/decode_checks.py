"""The engine's greedy tokens with PDL on and off, and with the fused ops against the reference ops.

- PDL: the same requests decoded ``--repeats`` times with ``engine.pdl=on`` and with
  ``engine.pdl=off`` in float32, ``--steps`` decode steps each (at least 2000): every run must
  give the same tokens. The fused kernels are deterministic, so a difference is a race.
  Batches of 2 (every projection a fused PDL kernel) and 8 (some on cuBLAS) are both run.
- fused vs reference: float32, the fused ops' tokens equal the reference ops' tokens.

    python3 benchmarks/decode_checks.py --steps 2000 --repeats 3 --out checks.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from corelib.engine import Engine, SamplingParams


def engine(model: str, rows: int, *overrides: str) -> Engine:
    sizes = ",".join(str(size) for size in (1, 2, 4, 8) if size <= rows)
    return Engine.from_overrides(["backend=cuda", "backend.runtime=native", f"model={model}", "model.dtype=float32",
                                  "model.init=device", "engine.async_token_handoff=on", f"engine.max_num_seqs={rows}",
                                  f"engine.graph_batch_sizes=[{sizes}]", *overrides])


def prompts(count: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 5000 + 2 for j in range(5 + 5 * i)] for i in range(count)]  # 2000 steps fit in 2048


def decode(eng: Engine, count: int, steps: int) -> list[list[int]]:
    outputs = eng.generate(prompts(count), SamplingParams(max_tokens=steps, ignore_eos=True))
    return [o.output_token_ids for o in outputs]


def first_difference(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per request: tokens before the first difference."""
    return [next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
            for x, y in zip(a, b, strict=True)]


def pdl_check(model: str, rows: int, steps: int, repeats: int) -> dict[str, Any]:
    runs: dict[str, list[list[list[int]]]] = {}
    pdl_used = {}
    for mode in ("on", "off"):
        with engine(model, rows, f"engine.pdl={mode}") as eng:
            pdl_used[mode] = eng.options.pdl
            runs[mode] = [decode(eng, rows, steps) for _ in range(repeats)]
    first = runs["off"][0]
    equal = all(run == first for mode in runs for run in runs[mode])
    worst = min(min(first_difference(first, run)) for mode in runs for run in runs[mode])
    return {"model": model, "batch": rows, "steps": steps, "repeats": repeats, "pdl_enabled": pdl_used["on"],
            "all_equal": equal, "fewest_equal_tokens": worst}


def fused_check(model: str, rows: int, steps: int) -> dict[str, Any]:
    tokens = {}
    for mode in ("off", "on"):
        with engine(model, rows, f"engine.fused_ops={mode}") as eng:
            tokens[mode] = decode(eng, rows, steps)
    agreement = first_difference(tokens["off"], tokens["on"])
    return {"model": model, "batch": rows, "steps": steps, "equal": tokens["off"] == tokens["on"],
            "tokens_before_first_difference": agreement}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small-0.6b")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fused-steps", type=int, default=128)
    parser.add_argument("--out", default="checks.json")
    args = parser.parse_args()
    pdl = [pdl_check(args.model, rows, args.steps, args.repeats) for rows in (2, 8)]
    fused = fused_check(args.model, 6, args.fused_steps)
    with open(args.out, "w") as out:
        json.dump({"pdl": pdl, "fused_vs_reference": fused}, out, indent=2)
    for row in pdl:
        verdict = "equal" if row["all_equal"] else f"DIFFER (first after {row['fewest_equal_tokens']} tokens)"
        print(f"PDL on/off, float32, bs {row['batch']}, {row['repeats']} x {row['steps']} steps each "
              f"(PDL {'on' if row['pdl_enabled'] else 'NOT enabled'}): {verdict}")
    print(f"fused vs reference tokens, float32, bs {fused['batch']} x {fused['steps']}: "
          f"{'equal' if fused['equal'] else 'DIFFER: ' + str(fused['tokens_before_first_difference'])}")


if __name__ == "__main__":
    main()
