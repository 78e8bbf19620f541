"""The GEMV's tiles per product shape, chosen in the decode step replayed as a graph.

The GEMV's tile (weight bytes per program) and the programs it wants per multiprocessor are global
``Tuning`` fields; ``Tuning.gemv_shape_tiles`` sets both for one product shape. For each model, this
finds the shapes each swept batch size's step sends to the GEMV (by recording the kernel's plans
over one eager step), then, one shape at a time (the shapes before it as already chosen, those after
it on the general tile), times the whole step under each (tile, programs per SM) option at that batch
size, in rounds that alternate the order. A shape keeps the option with the lowest mean if it beats the
general tile by more than ``--min-gain`` of the step. The step is the one ``decode_step.py`` builds: the
block tables as wide as the engine's narrowest decode graph that holds the context. Last, the
general tile and every kept option together are timed side by side at several batch sizes, with the
logits compared (largest error relative to their scale; whether every row's argmax agrees).

    python3 benchmarks/gemv_tiles.py --models small-0.6b llama-1b llama-8b --out gemv-tiles.json

The lines it prints last are the entries of ``Tuning.gemv_shape_tiles`` it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import statistics
from collections.abc import Callable
from typing import Any

import decode_step
import torch
import triton
from corelib_cuda.triton_ops import TritonOps, linear

from corelib.ops.reference import reference_ops

Shape = tuple[int, int, int, int]  # M, N, K, sets (2: the kernel's paired rows)
Option = tuple[int, int]  # tile bytes, programs per multiprocessor


def gemv_shapes(run: Callable[[], None]) -> list[Shape]:
    """The weight shapes the GEMV plans for while ``run`` runs, in the order it first meets them."""
    seen: list[Shape] = []
    plan = linear.gemv_plan

    def record(m: int, n_out: int, k: int, sets: int, *rest: Any) -> linear.GemvPlan:
        if (m, n_out, k, sets) not in seen:
            seen.append((m, n_out, k, sets))
        return plan(m, n_out, k, sets, *rest)

    linear.gemv_plan = record  # type: ignore[assignment]
    try:
        run()
    finally:
        linear.gemv_plan = plan
    return seen


def eager_step(model: Any, inputs: Any, cache: Any, ops: Any) -> None:
    model.forward(inputs, cache, ops)
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["small-0.6b", "llama-1b", "llama-8b"])
    parser.add_argument("--tiles", nargs="+", type=int, default=[8192, 16384, 32768, 65536])
    parser.add_argument("--per-sm", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--batches", nargs="+", type=int, default=[1], help="the batch sizes swept")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--min-gain", type=float, default=0.002, help="of the step, for an option to be kept")
    parser.add_argument("--check-batches", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--out", default="gemv-tiles.json")
    args = parser.parse_args()
    device = decode_step.open_device()
    ops = reference_ops().with_provider("triton", TritonOps().load(device, pdl=True))
    default = linear.TUNING
    default_option = (default.gemv_tile_bytes, default.gemv_programs_per_sm)
    options = list(itertools.product(args.tiles, args.per_sm))
    report: dict[str, Any] = {"context": args.context, "options": options, "models": {}}

    def step(model: Any, batch: int, table: dict[Shape, Option]) -> dict[str, Any]:
        linear.TUNING = dataclasses.replace(default, gemv_shape_tiles=tuple((*s, *o) for s, o in table.items()))
        inputs, cache = decode_step.step_inputs(model, batch, args.context)
        return decode_step.replay(model, ops, inputs, cache, 5)

    try:
        for name in args.models:
            model = decode_step.load(name, "bfloat16", device)
            kept: dict[Shape, Option] = {}
            sweeps: dict[str, Any] = {}
            for batch in args.batches:
                inputs, cache = decode_step.step_inputs(model, batch, args.context)
                for shape in gemv_shapes(functools.partial(eager_step, model, inputs, cache, ops)):
                    times: dict[Option, list[float]] = {o: [] for o in options}
                    for r in range(args.rounds):
                        for option in options if r % 2 == 0 else options[::-1]:
                            try:
                                us = step(model, batch, {**kept, shape: option})["us_per_step"]
                            except triton.runtime.errors.OutOfResources:  # a tile too large for this GPU
                                us = math.inf
                            times[option].append(us)
                    means = {o: statistics.mean(t) for o, t in times.items()}
                    best = min(means, key=means.__getitem__)
                    base = means[default_option]
                    if best != default_option and base - means[best] > args.min_gain * base:
                        kept[shape] = best
                    sweeps[str(shape)] = {str(o): t for o, t in times.items()}
                    print(f"{name:>11} M {shape[0]} N {shape[1]:>6} K {shape[2]:>5} sets {shape[3]}  "
                          + "  ".join(f"{o[0] // 1024}k/{o[1]} {means[o]:7.1f}" for o in options)
                          + f"  -> {kept.get(shape, default_option)}", flush=True)
            checks = []
            for batch in args.check_batches:
                sides: dict[str, list[float]] = {"default": [], "shapes": []}
                logits: dict[str, torch.Tensor] = {}
                for r in range(3):
                    for side in ("default", "shapes") if r % 2 == 0 else ("shapes", "default"):
                        result = step(model, batch, {} if side == "default" else kept)
                        sides[side].append(result["us_per_step"])
                        logits.setdefault(side, result["logits"])
                error = decode_step.relative_error(logits["shapes"], logits["default"])
                same = bool(torch.equal(logits["shapes"].argmax(-1), logits["default"].argmax(-1)))
                checks.append({"batch": batch, **sides, "relative_error": error, "argmax_equal": same})
                print(f"{name:>11} bs {batch:>3}  default {min(sides['default']):8.1f} us  per shape "
                      f"{min(sides['shapes']):8.1f} us  ({min(sides['shapes']) / min(sides['default']):.3f})  "
                      f"err {error:.1e} argmax {'=' if same else '!='}", flush=True)
            report["models"][name] = {"sweeps": sweeps, "checks": checks,
                                      "kept": [(*s, *o) for s, o in kept.items()]}
            del model
            torch.cuda.empty_cache()
    finally:
        linear.TUNING = default
    with open(args.out, "w") as out:
        json.dump(report, out, indent=2)
    for name, found in report["models"].items():
        for entry in found["kept"]:
            print(f"    {tuple(entry)},  # {name}")


if __name__ == "__main__":
    main()
