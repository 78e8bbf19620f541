"""Kernels per decode step and device time per step by kernel class, reference vs fused ops.

Runs decode steps eagerly (graphs off, so the profiler sees each launch) under torch.profiler
and classifies every CUDA kernel of one steady decode step. Kernels per layer are counted as
the difference between the model and the same model with half its layers, over the layers
removed: the kernels run once per step (embedding, final norm, LM head, sampling, token
copies) cancel out.

    python3 benchmarks/kernels.py --model small-0.6b --batch 1 32 --out kernels.json
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from corelib.engine import Engine, SamplingParams

CLASSES = (
    ("gemm", re.compile(r"gemm|cutlass|sm90|nvjet|cublas|matmul", re.I)),
    ("attention", re.compile(r"attention|attn|flash|sdpa|fmha|softmax", re.I)),
    ("norm", re.compile(r"norm", re.I)),
    ("rope/kv write", re.compile(r"rope|rotary|index_copy|scatter", re.I)),
    ("sampling", re.compile(r"argmax|sort|topk|cumsum|gumbel|sample", re.I)),
    ("gather/index", re.compile(r"index|gather", re.I)),
    ("copy", re.compile(r"copy|memcpy|memset|fill", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|reduce|silu|mul|add|cat|where", re.I)),
)


def kernel_class(name: str) -> str:
    for label, pattern in CLASSES:
        if pattern.search(name):
            return label
    return "other"


def profile_steps(model: str, fused: str, batch: int, steps: int, layers: int | None = None) -> dict[str, Any]:
    overrides = ["backend=cuda", "backend.runtime=native", f"model={model}", "engine.graph=off", "model.init=device",
                 f"engine.fused_ops={fused}", "engine.async_token_handoff=off", f"engine.max_num_seqs={batch}"]
    if layers is not None:
        overrides.append(f"model.num_layers={layers}")
    with Engine.from_overrides(overrides) as engine:
        layers = engine.startup.config.model.num_layers
        prompts = [[(i * 131 + j * 17) % 5000 + 2 for j in range(32)] for i in range(batch)]
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True), request_id=str(i))
        for _ in range(6):  # prefill and a few decode steps: warm caches and Triton's compiler
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        for _ in engine.stream():
            pass
    count: Counter[str] = Counter()
    time_us: dict[str, float] = defaultdict(float)
    total = 0
    for event in prof.events():
        if not str(event.device_type).endswith("CUDA"):
            continue
        label = kernel_class(event.name)
        count[label] += 1
        time_us[label] += event.device_time
        total += 1
    return {
        "model": model, "fused_ops": fused, "batch": batch, "steps": steps, "layers": layers,
        "kernels_per_step": total / steps, "kernels_per_layer": total / steps / layers,
        "by_class": {k: {"kernels_per_step": count[k] / steps, "us_per_step": time_us[k] / steps}
                     for k in sorted(count)},
        "device_ms_per_step": sum(time_us.values()) / steps / 1e3,
    }


def per_layer(model: str, fused: str, batch: int, steps: int) -> dict[str, Any]:
    """The full model's profile, with kernels per layer from the difference to half its layers."""
    full = profile_steps(model, fused, batch, steps)
    half = profile_steps(model, fused, batch, steps, layers=full["layers"] // 2)
    removed = full["layers"] - half["layers"]
    full["kernels_per_layer"] = (full["kernels_per_step"] - half["kernels_per_step"]) / removed
    full["kernels_outside_layers"] = full["kernels_per_step"] - full["kernels_per_layer"] * full["layers"]
    return full


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", default=["small-0.6b"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--fused", nargs="+", default=["off", "on"], help="fused_ops modes to profile")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="kernels.json")
    args = parser.parse_args()
    results = [per_layer(model, fused, batch, args.steps) for model in args.model for batch in args.batch
               for fused in args.fused]
    with open(args.out, "w") as out:
        json.dump(results, out, indent=2)
    print(f"{'model':>11} {'ops':>9} {'bs':>4} {'kernels/step':>13} {'kernels/layer':>14} {'outside':>8} "
          f"{'device ms/step':>15}")
    for r in results:
        ops = "fused" if r["fused_ops"] == "on" else "reference"
        print(f"{r['model']:>11} {ops:>9} {r['batch']:>4} {r['kernels_per_step']:>13.0f} "
              f"{r['kernels_per_layer']:>14.1f} {r['kernels_outside_layers']:>8.0f} {r['device_ms_per_step']:>15.3f}")
        print("          " + ", ".join(f"{k} {v['kernels_per_step']:.0f}/{v['us_per_step']:.0f}us"
                                      for k, v in r["by_class"].items()))


if __name__ == "__main__":
    main()
