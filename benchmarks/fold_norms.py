"""Device time of one decode step (replayed as a CUDA graph, Triton ops with PDL) with the norms' weights as the
checkpoint has them and folded into the qkv and gate/up weights (what the engine does for the cuda provider),
alternating on one model load, with each layer's kernel count (a profiled replay) and how far the folded
step's logits move from the plain one's.

    python3 benchmarks/fold_norms.py --models small-0.6b llama-1b --batches 1 8 32 64 128 --rounds 2 --out fold.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import decode_step
import torch
from corelib_cuda.triton_ops import TritonOps

from corelib.models.llama import LlamaModel
from corelib.ops.reference import reference_ops


def _set_folded(model: LlamaModel, plain: list[tuple[torch.Tensor, torch.Tensor]],
                folded: list[tuple[torch.Tensor, torch.Tensor]], on: bool) -> None:
    for layer, weights in zip(model.weights.layers, folded if on else plain, strict=True):
        layer.qkv, layer.gate_up = weights
        layer.norms_folded = on


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["small-0.6b", "llama-1b"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64, 128])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", type=int, default=10, metavar="STEPS", help="replays profiled for the kernels")
    parser.add_argument("--clones", action="store_true",
                        help="the plain weights as copies made after folding (where each variant's weights lie)")
    parser.add_argument("--out", default="fold.json")
    args = parser.parse_args()
    device = decode_step.open_device()
    ops = reference_ops().with_provider("triton", TritonOps().load(device, pdl=True))
    rows: list[dict[str, Any]] = []
    for name in args.models:
        model = decode_step.load(name, "bfloat16", device)
        plain = [(layer.qkv, layer.gate_up) for layer in model.weights.layers]
        assert model.fold_norm_weights()
        folded = [(layer.qkv, layer.gate_up) for layer in model.weights.layers]
        if args.clones:  # the plain weights again in memory allocated after the model's, as the folded weights are
            plain = [(qkv.clone(), gate_up.clone()) for qkv, gate_up in plain]
        for batch in args.batches:
            inputs, cache = decode_step.step_inputs(model, batch, args.context)
            times: dict[str, list[float]] = {"plain": [], "folded": []}
            found: dict[str, dict[str, Any]] = {}
            for round_ in range(args.rounds):
                for label in ("plain", "folded") if round_ % 2 == 0 else ("folded", "plain"):
                    _set_folded(model, plain, folded, label == "folded")
                    profile = args.profile if round_ == 0 else 0
                    result = decode_step.replay(model, ops, inputs, cache, 3, profile)
                    times[label].append(result["us_per_step"])
                    if round_ == 0:
                        found[label] = result
            row = {"model": name, "batch": batch, "plain_us": times["plain"], "folded_us": times["folded"],
                   "ratio": statistics.median(times["folded"]) / statistics.median(times["plain"]),
                   "kernels_per_layer": {label: len(found[label]["layer"]) for label in found},
                   "layer": {label: found[label]["layer"] for label in found},
                   "relative_error": decode_step.relative_error(found["folded"]["logits"], found["plain"]["logits"]),
                   "argmax_equal": bool(torch.equal(found["folded"]["logits"].argmax(-1),
                                                    found["plain"]["logits"].argmax(-1)))}
            rows.append(row)
            print(f"{name:>11} bs {batch:>3} plain {statistics.median(times['plain']):8.1f} us  folded "
                  f"{statistics.median(times['folded']):8.1f} us  ratio {row['ratio']:.3f}  kernels/layer "
                  f"{row['kernels_per_layer'].get('plain')} -> {row['kernels_per_layer'].get('folded')}  "
                  f"err {row['relative_error']:.1e} argmax {'=' if row['argmax_equal'] else '!='}", flush=True)
        del model, plain, folded
        torch.cuda.empty_cache()
    with open(args.out, "w") as out:
        json.dump({"context": args.context, "rounds": args.rounds, "steps": rows}, out, indent=2)


if __name__ == "__main__":
    main()
