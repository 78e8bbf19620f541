"""Device time of one decode step (replayed as a CUDA graph, Triton ops with PDL) under changes to
the projections' ``Tuning``: how the GEMV's tiles and the kernel thresholds were chosen.

Each configuration is a label and a JSON object of ``Tuning`` fields; every one is timed at its own
batch sizes on the same model load (the step of benchmarks/decode_step.py, a 64-token context). Each
step's logits are compared with the first configuration's at that batch size (the same inputs): the
largest error relative to their scale, and whether every row's argmax agrees.

    python3 benchmarks/projection_tuning.py --models small-0.6b llama-1b --out tuning.json \\
        --config default '{}' 1 2 4 --config t32k-p2 '{"gemv_tile_bytes": 32768, "gemv_programs_per_sm": 2}' 1 2 4

The norms' weights are folded into the qkv and gate/up weights, as the engine folds them for the Triton provider
(``--fold-norms off``: as the checkpoint has them, so that beside cuBLAS two norm kernels a layer run which the
engine does not run).

With ``--profile N`` each step's kernels are listed too (N more replays under torch's profiler), by name
and share, and one decoder layer's kernels in launch order with the idle time after each: where a
configuration's time goes, kernel by kernel. ``--pdl off`` launches plainly, so that
each kernel's time is its own (under PDL it counts from the early launch).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import decode_step
import torch
import triton
from corelib_cuda.triton_ops import TritonOps, linear

from corelib.ops.reference import reference_ops


def _tupled(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _tupled(item) for key, item in value.items()}
    if isinstance(value, list):
        return tuple(_tupled(item) for item in value)
    return value


def tuning_changes(text: str) -> dict[str, Any]:
    """``Tuning`` fields from JSON, its lists as tuples, so that a ``Tuning`` holding a table stays hashable (its
    plans are cached by it)."""
    changes: dict[str, Any] = _tupled(json.loads(text))
    return changes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["small-0.6b", "llama-1b"])
    parser.add_argument("--config", nargs="+", action="append", required=True, metavar="LABEL JSON BATCH",
                        help="a label, the Tuning fields changed (JSON), then batch sizes")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="also each step's kernels over this many replays, under torch's profiler (0: none)")
    parser.add_argument("--pdl", choices=["on", "off"], default="on")
    parser.add_argument("--fold-norms", choices=["on", "off"], default="on",
                        help="the norms' weights folded into the projections, as the engine folds them (default on)")
    parser.add_argument("--out", default="tuning.json")
    args = parser.parse_args()
    configs = [(label, tuning_changes(changes), [int(b) for b in batches])
               for label, changes, *batches in args.config]
    device = decode_step.open_device()
    ops = reference_ops().with_provider("triton", TritonOps().load(device, pdl=args.pdl == "on"))
    default = linear.TUNING
    rows: list[dict[str, Any]] = []
    try:
        for name in args.models:
            model = decode_step.load(name, "bfloat16", device, fold_norms=args.fold_norms == "on")
            first: dict[int, torch.Tensor] = {}
            for label, changes, batches in configs:
                linear.TUNING = dataclasses.replace(default, **changes)
                for batch in batches:
                    inputs, cache = decode_step.step_inputs(model, batch, args.context)
                    try:
                        result = decode_step.replay(model, ops, inputs, cache, 5, args.profile)
                    except triton.runtime.errors.OutOfResources as error:  # a tile too large for this GPU
                        print(f"{name} bs {batch} {label}: {error}", flush=True)
                        continue
                    logits = first.setdefault(batch, result["logits"])
                    rows.append({"model": name, "label": label, "tuning": changes, "batch": batch,
                                 "us_per_step": result["us_per_step"],
                                 "replays_identical": result["replays_identical"],
                                 "relative_error": decode_step.relative_error(result["logits"], logits),
                                 "argmax_equal": bool(torch.equal(result["logits"].argmax(-1), logits.argmax(-1))),
                                 "kernels": result["kernels"], "layer": result["layer"]})
                    print(json.dumps(rows[-1]), flush=True)
            del model
            torch.cuda.empty_cache()
    finally:
        linear.TUNING = default
    with open(args.out, "w") as out:
        json.dump({"context": args.context, "pdl": args.pdl, "fold_norms": args.fold_norms,
                   "default": dataclasses.asdict(default), "steps": rows}, out, indent=2)
    for r in rows:
        print(f"{r['model']:>11} bs {r['batch']:>3} {r['label']:>24} {r['us_per_step']:9.1f} us "
              f"err {r['relative_error']:.1e} argmax {'=' if r['argmax_equal'] else '!='}")
        if r["kernels"]:
            total = sum(k["us_per_step"] for k in r["kernels"])
            print(f"{'':>16} kernels {total:.1f} us a step ({total / r['us_per_step']:.2f} of the step):")
            for k in r["kernels"][:12]:
                print(f"{'':>18} {k['us_per_step']:8.1f} us  {k['calls_per_step']:5.0f} x {k['us_per_call']:6.2f}  "
                      f"{k['kernel'][:70]}")
            print(f"{'':>16} one layer, in order (us, idle after):")
            for k in r["layer"]:
                idle = "" if k["idle_after_us"] is None else f"{k['idle_after_us']:6.2f}"
                print(f"{'':>18} {k['us']:7.2f} {idle:>6}  {k['kernel'][:70]}")


if __name__ == "__main__":
    main()
