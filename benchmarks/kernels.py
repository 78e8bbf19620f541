"""Kernels per decode step and device time per step by kernel class, reference vs fused ops;
the bandwidth each of the decode layer's projection kernels achieves.

Runs decode steps eagerly (graphs off; with ``--engine-graphs``, the engine's own graph of the
batch size, replayed) under torch.profiler and classifies every CUDA kernel of one steady decode
step. Kernels per layer are counted as the difference between the model and the same model with
half its layers, over the layers removed: the kernels run once per step (embedding, final norm, LM
head, sampling, token copies) cancel out. An eager step's block tables are as wide as its live
context, so its attention splits that, not the wider table of the graph the engine replays: where
the graph's attention splits and the eager one does not, the eager count leaves out the merge
kernel. In a replayed graph the kernels launched early under PDL overlap their predecessors (each
one's time counts from its launch, its wait included), so there the device time summed over the
kernels runs past the step's.

With ``--graph`` it also counts the kernels of the step the engine replays: the model's decode
step captured as a CUDA graph at the engine's table width for a context of ``--context`` tokens
(``decode_step``: the Triton ops with PDL, the norms folded as the engine folds them), one layer's
kernels in launch order from the profiled replays (from one decode attention kernel to the next).

With ``--bandwidth`` it also times each fused projection op of the model (the one the engine
calls, at the batch size given, with PDL) in a CUDA graph of back-to-back calls, each over its
own copy of the weight so that every call reads it from memory, and reports the weight bytes
over the time against the device's copy rate (peers.py's: a device-to-device copy of 1 GiB,
bytes read and written over its time).

    python3 benchmarks/kernels.py --model small-0.6b --batch 1 32 --out kernels.json
    python3 benchmarks/kernels.py --model small-0.6b llama-1b --batch 1 32 64 --fused --graph
    python3 benchmarks/kernels.py --model small-0.6b llama-1b --batch 1 --fused --bandwidth --out bw.json
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import decode_step
import peers
import projections
import torch
from torch.profiler import ProfilerActivity, profile

from corelib.engine import Engine, SamplingParams
from corelib.ops.reference import reference_ops
from corelib.startup.compose import compose_config

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


def profile_steps(model: str, fused: str, batch: int, steps: int, layers: int | None = None,
                  graphs: bool = False) -> dict[str, Any]:
    graph = [f"engine.graph_batch_sizes=[{batch}]"] if graphs else ["engine.graph=off"]
    overrides = ["backend=cuda", "backend.runtime=native", f"model={model}", *graph, "model.init=device",
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
    by_name: Counter[str] = Counter()
    time_us: dict[str, float] = defaultdict(float)
    total = 0
    for event in prof.events():
        if not str(event.device_type).endswith("CUDA"):
            continue
        label = kernel_class(event.name)
        count[label] += 1
        by_name[_short(event.name)] += 1
        time_us[label] += event.device_time
        total += 1
    return {
        "model": model, "fused_ops": fused, "batch": batch, "steps": steps, "layers": layers, "graphs": graphs,
        "by_name": {name: n / steps for name, n in by_name.most_common()},
        "kernels_per_step": total / steps, "kernels_per_layer": total / steps / layers,
        "by_class": {k: {"kernels_per_step": count[k] / steps, "us_per_step": time_us[k] / steps}
                     for k in sorted(count)},
        "device_ms_per_step": sum(time_us.values()) / steps / 1e3,
    }


def per_layer(model: str, fused: str, batch: int, steps: int, graphs: bool = False) -> dict[str, Any]:
    """The full model's profile, with kernels per layer from the difference to half its layers."""
    full = profile_steps(model, fused, batch, steps, graphs=graphs)
    half = profile_steps(model, fused, batch, steps, layers=full["layers"] // 2, graphs=graphs)
    removed = full["layers"] - half["layers"]
    full["kernels_per_layer"] = (full["kernels_per_step"] - half["kernels_per_step"]) / removed
    full["kernels_outside_layers"] = full["kernels_per_step"] - full["kernels_per_layer"] * full["layers"]
    return full


def graph_layers(model: str, batches: list[int], context: int, replays: int) -> list[dict[str, Any]]:
    """Per batch size, one decoder layer's kernels in the decode step the engine replays (see the module's
    docstring), and the kernels of the step outside its layers (the embedding, the final norm and LM head)."""
    from corelib_cuda.triton_ops import TritonOps

    device = decode_step.open_device()
    rows = []
    try:
        ops = reference_ops().with_provider("triton", TritonOps().load(device, pdl=True))
        loaded = decode_step.load(model, "bfloat16", device, fold_norms=True)
        for batch in batches:
            inputs, cache = decode_step.step_inputs(loaded, batch, context)
            result = decode_step.replay(loaded, ops, inputs, cache, 2, replays)
            layer = result["layer"]  # each kernel's name, µs (from its launch under PDL) and idle µs after it
            per_step = sum(k["calls_per_step"] for k in result["kernels"])
            rows.append({"model": model, "batch": batch, "context": context, "us_per_step": result["us_per_step"],
                         "kernels_per_step": per_step, "kernels_per_layer": len(layer),
                         "kernels_outside_layers": per_step - len(layer) * loaded.shape.num_layers, "layer": layer})
            del inputs, cache
        del loaded
    finally:
        device.close()
    return rows


def projection_calls(model: str, batch: int) -> list[tuple[str, int, int, Callable[[torch.Tensor], object]]]:
    """(name, N, K, the op called with an [N, K] weight) of the model's decode-layer projections and LM head."""
    from corelib_cuda.triton_ops import layer_ops, linear

    cfg = compose_config([f"model={model}"]).model
    hidden, heads, kv_heads, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    inter, vocab, eps = cfg.intermediate_size, cfg.vocab_size, 1e-6

    def bf16(*size: int) -> torch.Tensor:
        return torch.randn(*size, device="cuda", dtype=torch.bfloat16)

    h, attn_out, act, residual = bf16(batch, hidden), bf16(batch, heads * hd), bf16(batch, inter), bf16(batch, hidden)
    norm_weight = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = bf16(batch + 1, 16, kv_heads, hd), bf16(batch + 1, 16, kv_heads, hd)
    positions = torch.arange(batch, device="cuda")
    cos_sin = bf16(batch + 16, 2, hd)
    slots = torch.arange(batch, device="cuda") * 16
    return [
        ("qkv (norm, RoPE, KV write)", (heads + 2 * kv_heads) * hd, hidden,
         lambda w: layer_ops.norm_qkv_rope_kv_write(h, norm_weight, eps, w, None, positions, cos_sin, k_cache, v_cache,
                                                    slots, pdl=True)),
        ("o (+ residual)", hidden, heads * hd, lambda w: linear.linear_residual(attn_out, w, residual, pdl=True)),
        ("gate_up (norm, SiLU-mul)", 2 * inter, hidden,
         lambda w: layer_ops.norm_gate_up_silu_mul(h, norm_weight, eps, w, pdl=True)),
        ("down (+ residual)", hidden, inter, lambda w: linear.linear_residual(act, w, residual, pdl=True)),
        ("lm_head (norm, logits)", vocab, hidden, lambda w: layer_ops.norm_logits(h, norm_weight, eps, w, pdl=True)),
    ]


def bandwidth(model: str, batch: int, rate: float) -> list[dict[str, Any]]:
    """Each projection kernel's µs and achieved bandwidth (weight bytes over time) at ``batch`` rows."""
    from corelib_cuda.triton_ops import linear

    rows = []
    for name, n, width, call in projection_calls(model, batch):
        size = n * width * 2
        copies = projections.weights(n, width)  # together several times the L2: every call reads from memory
        us = projections.timed([functools.partial(call, w) for w in copies])
        kernel = linear.kernel_for(batch, n, width, 2).value
        rows.append({"model": model, "batch": batch, "projection": name, "n": n, "k": width, "kernel": kernel,
                     "weight_mb": size / 2**20, "us": us, "tb_per_s": size / (us * 1e-6) / 1e12,
                     "of_copy_rate": size / (us * 1e-6) / rate})
        del copies
    return rows


def _short(kernel: str) -> str:
    """A kernel's name without its template arguments and parameter list, at most 28 characters."""
    return re.split(r"[<(]", kernel, maxsplit=1)[0][:28]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", default=["small-0.6b"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--fused", nargs="*", default=["off", "on"], help="fused_ops modes to profile (none: skip)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="kernels.json")
    parser.add_argument("--bandwidth", action="store_true", help="each projection kernel's achieved bandwidth too")
    parser.add_argument("--bandwidth-out", default="bandwidth.json")
    parser.add_argument("--graph", action="store_true", help="the kernels of the graph-replayed step too")
    parser.add_argument("--engine-graphs", action="store_true",
                        help="the engine's steps with its graphs on (a graph of the batch size) instead of eagerly")
    parser.add_argument("--context", type=int, default=64, help="cached tokens a row, for --graph")
    parser.add_argument("--graph-out", default="graph_kernels.json")
    args = parser.parse_args()
    if args.graph:
        graphs = [row for model in args.model for row in graph_layers(model, args.batch, args.context, args.steps)]
        with open(args.graph_out, "w") as out:
            json.dump(graphs, out, indent=2)
        print(f"the graph-replayed step, context {args.context}:")
        print(f"{'model':>11} {'bs':>4} {'kernels/layer':>14} {'outside':>8} {'us/step':>8}  one layer (kernel µs)")
        for r in graphs:
            names = ", ".join(f"{_short(k['kernel'])} {k['us']:.1f}" for k in r["layer"])
            print(f"{r['model']:>11} {r['batch']:>4} {r['kernels_per_layer']:>14} {r['kernels_outside_layers']:>8.0f} "
                  f"{r['us_per_step']:>8.1f}  {names}")
    if args.bandwidth:
        device = decode_step.open_device()
        try:
            rate = peers.copy_bandwidth(device, 1024)  # 1 GiB, read + written
        finally:
            device.close()
        rows = [row for model in args.model for batch in args.batch for row in bandwidth(model, batch, rate)]
        with open(args.bandwidth_out, "w") as out:
            json.dump({"copy_rate_tb_per_s": rate / 1e12, "kernels": rows}, out, indent=2)
        print(f"copy rate {rate / 1e12:.2f} TB/s (1 GiB device-to-device, read + written)")
        print(f"{'model':>11} {'bs':>4} {'projection':>27} {'kernel':>7} {'MB':>7} {'us':>8} {'TB/s':>6} "
              f"{'of copy':>8}")
        for r in rows:
            print(f"{r['model']:>11} {r['batch']:>4} {r['projection']:>27} {r['kernel']:>7} {r['weight_mb']:>7.1f} "
                  f"{r['us']:>8.2f} {r['tb_per_s']:>6.2f} {100 * r['of_copy_rate']:>7.0f}%")
    if not args.fused:
        return
    results = [per_layer(model, fused, batch, args.steps, args.engine_graphs) for model in args.model
               for batch in args.batch for fused in args.fused]
    with open(args.out, "w") as out:
        json.dump(results, out, indent=2)
    if args.engine_graphs:
        print("the engine's graphs replayed: under PDL the kernels' times overlap, device ms/step sums past the step")
    print(f"{'model':>11} {'ops':>9} {'bs':>4} {'kernels/step':>13} {'kernels/layer':>14} {'outside':>8} "
          f"{'device ms/step':>15}")
    for r in results:
        ops = "fused" if r["fused_ops"] == "on" else "reference"
        print(f"{r['model']:>11} {ops:>9} {r['batch']:>4} {r['kernels_per_step']:>13.0f} "
              f"{r['kernels_per_layer']:>14.1f} {r['kernels_outside_layers']:>8.0f} {r['device_ms_per_step']:>15.3f}")
        print("          " + ", ".join(f"{k} {v['kernels_per_step']:.0f}/{v['us_per_step']:.0f}us"
                                      for k, v in r["by_class"].items()))
        # the kernels launched a few times a step: the step's own, outside its layers
        print("          once or twice a step: " + ", ".join(f"{name} x{n:g}" for name, n in r["by_name"].items()
                                                            if n < r["layers"] / 2))


if __name__ == "__main__":
    main()
