"""Device time of one decode step, replayed as a CUDA graph, without the engine around it.

For each model and batch size the step is the model's ``decode`` over a paged cache holding a
random context of ``--context`` tokens (the block table as wide as max_model_len, as the
engine's graphs are), captured once per op set and replayed:

- ``reference``: the plain-torch ops; ``triton``: the Triton provider; ``triton+pdl``: the same
  launched with programmatic dependent launch.
- checks: every replay's logits equal the first replay's, bit for bit, and PDL's equal the
  plain launch's (both are deterministic: a difference is a race); the Triton logits against
  the reference ops' (same dtype); with ``--bf16-bound``, bfloat16 Triton logits against the
  float32 model with the reference ops over teacher-forced steps (the stated error bound).

    python3 benchmarks/decode_step.py --models small-0.6b llama-1b --batch 1 32 --out step.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Callable
from typing import Any

import torch
from corelib_cuda.backend import CUDABackend
from corelib_cuda.triton_ops import TritonOps
from omegaconf import OmegaConf

from corelib.config.schema import EngineConfig, ModelConfig
from corelib.models.base import StepBatch
from corelib.models.llama import KVCache, LlamaModel
from corelib.models.registry import architecture
from corelib.ops import Ops, PagedAttention
from corelib.ops.reference import reference_ops
from corelib.platform.backend import DeviceSpec
from corelib.platform.device import Capabilities, Device, Runtime
from corelib.startup.compose import compose_config
from corelib.step.buckets import BucketPolicy, blocks_for

BLOCK = 16


def open_device() -> Device:
    caps = Capabilities(streams=True, events=True, event_query=True, event_timing=True, graphs=True)
    return CUDABackend().open(DeviceSpec(backend="cuda", runtime=Runtime.native, capabilities=caps))


def load(name: str, dtype: str, device: Device, *extra: str, fold_norms: bool = False) -> LlamaModel:
    """Model ``name`` with random weights on ``device``; with ``fold_norms`` its norms' weights folded into the qkv
    and gate/up weights, as the engine folds them for a provider that runs the fused norm ops (the Triton one):
    beside a cuBLAS product no norm kernel then runs, so a step timed without it pays two kernels a layer that the
    engine does not."""
    raw = compose_config([f"model={name}", f"model.dtype={dtype}", "model.init=device", *extra]).model
    cfg = OmegaConf.to_object(raw)
    assert isinstance(cfg, ModelConfig)
    model = architecture(cfg.architecture).load(cfg, device, None, False)
    assert isinstance(model, LlamaModel)
    if fold_norms:
        assert model.fold_norm_weights(), f"{name}'s norms cannot be folded"
    return model


def graph_width(max_model_len: int, tokens: int) -> int:
    """The block-table width (blocks) of the decode graph the engine replays for contexts up to ``tokens`` with
    attention that reads only live blocks and ``engine.graph_kv_sizes`` at its default (the engine's own rule)."""
    policy = BucketPolicy.build(True, [1], 1, max_model_len // BLOCK, False, True,
                                live_widths=[blocks_for(size, BLOCK) for size in EngineConfig().graph_kv_sizes])
    return policy.graph_kv(blocks_for(tokens, BLOCK))


def step_inputs(model: LlamaModel, batch: int, context: int, seed: int = 0) -> tuple[StepBatch, KVCache]:
    """Row b has ``context + b % 7`` cached tokens (random keys and values); its new token goes next."""
    shape, device = model.shape, model.weights.embed.device
    gen = torch.Generator(device=device).manual_seed(seed)
    width = graph_width(shape.max_model_len, context + 8)
    lengths = torch.tensor([context + b % 7 for b in range(batch)], device=device)
    live = -(-(context + 8) // BLOCK)
    data = torch.randn((shape.num_layers, 2, batch * live + 1, BLOCK, shape.num_kv_heads, shape.head_dim),
                       generator=gen, device=device).to(shape.dtype)
    tables = torch.zeros((batch, width), dtype=torch.int32, device=device)
    tables[:, :live] = 1 + torch.arange(batch * live, dtype=torch.int32, device=device).view(batch, live)
    slots = tables.long().gather(1, (lengths // BLOCK)[:, None])[:, 0] * BLOCK + lengths % BLOCK
    ids = torch.randint(0, shape.vocab_size, (batch,), generator=gen, device=device)
    attention = PagedAttention(tables, lengths + 1, BLOCK)
    return StepBatch(ids, lengths, slots, attention, torch.arange(batch, device=device)), KVCache(data, BLOCK)


def advance(inputs: StepBatch, token: torch.Tensor) -> StepBatch:
    """The next step of the same rows, fed ``token`` (a new PagedAttention: its key mask is cached)."""
    positions = inputs.positions + 1
    tables = inputs.attention.block_tables
    slots = tables.long().gather(1, (positions // BLOCK)[:, None])[:, 0] * BLOCK + positions % BLOCK
    attention = PagedAttention(tables, positions + 1, BLOCK)
    return StepBatch(token, positions, slots, attention, inputs.state_indices)


def replay(model: LlamaModel, ops: Ops, batch: StepBatch, cache: KVCache, replays: int,
           profile: int = 0) -> dict[str, Any]:
    """Capture one step, replay it; µs per step (best of 5 rounds) and whether every replay agreed; with
    ``profile``, the kernels of that many more replays under torch's profiler (:func:`kernels_of`)."""
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())  # the inputs were made on the current stream: wait for them
    with torch.cuda.stream(stream):
        model.forward(batch, cache, ops)  # compile and warm outside capture
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            logits = model.forward(batch, cache, ops)
        graph.replay()
        first = logits.clone()
        same = True
        for _ in range(replays):
            graph.replay()
            same &= bool(torch.equal(logits, first))
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        best = math.inf
        for _ in range(5):
            start.record(stream)
            for _ in range(20):
                graph.replay()
            end.record(stream)
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1000 / 20)
        kernels = kernels_of(graph.replay, profile) if profile else {"kernels": [], "layer": []}
    graph.reset()
    return {"us_per_step": best, "replays_identical": same, "logits": first, **kernels}


def kernels_of(run: Callable[[], None], steps: int) -> dict[str, Any]:
    """The device kernels of ``steps`` back-to-back calls of ``run`` (graph replays: the kernels inside them):
    ``kernels`` by name, largest share first; ``layer``, one decoder layer's kernels in launch order (from
    one attention kernel to the next, averaged over every such stretch of the usual length), each with its
    time and the idle time after it. Under PDL a kernel's time counts from its early launch, its wait
    included, and the idle times read 0."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    kernels = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0.0)
        if event.device_type.name == "CUDA" and device_us > 0:
            kernels.append({"kernel": event.key, "calls_per_step": event.count / steps,
                            "us_per_call": device_us / event.count, "us_per_step": device_us / steps})
    kernels.sort(key=lambda k: -k["us_per_step"])
    timeline = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    return {"kernels": kernels, "layer": layer_cycle(timeline)}


def layer_cycle(timeline: list[tuple[float, float, str]], marker: str = "_decode_kernel") -> list[dict[str, Any]]:
    """One layer's kernels from a timeline of (start, end, name), cut at each decode attention kernel."""
    cuts = [i for i, (_, _, name) in enumerate(timeline) if marker in name]
    cycles = [timeline[a:b] for a, b in itertools.pairwise(cuts)]
    if not cycles:
        return []
    lengths = [len(c) for c in cycles]
    usual = max(set(lengths), key=lengths.count)
    same = [c for c in cycles if len(c) == usual]
    layer = []
    for i in range(usual):
        spans = [c[i][1] - c[i][0] for c in same]
        gaps = [max(0.0, c[i + 1][0] - c[i][1]) for c in same if i + 1 < usual]
        layer.append({"kernel": same[0][i][2], "us": sum(spans) / len(spans),
                      "idle_after_us": sum(gaps) / len(gaps) if gaps else None})
    return layer


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())


def bf16_bound(name: str, device: Device, steps: int, batch: int, context: int) -> dict[str, Any]:
    """bfloat16 with the Triton ops against float32 with the reference ops, teacher-forced by the latter."""
    fused = reference_ops().with_provider("triton", TritonOps().load(device))
    low, high = load(name, "bfloat16", device), load(name, "float32", device)
    errors: dict[str, list[float]] = {"triton": [], "reference": []}
    agree = 0
    inputs_high, cache_high = step_inputs(high, batch, context)
    runs = {}
    for label in errors:
        inputs, cache = step_inputs(low, batch, context)
        cache.data.copy_(cache_high.data)  # the same context, rounded
        runs[label] = (inputs, cache)
    for _ in range(steps):
        logits_high = high.forward(inputs_high, cache_high, reference_ops())
        token = logits_high.argmax(-1)
        for label, ops in (("triton", fused), ("reference", reference_ops())):
            inputs, cache = runs[label]
            logits = low.forward(inputs, cache, ops)
            errors[label].append(relative_error(logits, logits_high))
            if label == "triton":
                agree += int((logits.argmax(-1) == token).sum())
            runs[label] = (advance(inputs, token), cache)
        inputs_high = advance(inputs_high, token)
    del low, high
    return {"model": name, "steps": steps, "batch": batch, "max_relative_error": max(errors["triton"]),
            "median_relative_error": sorted(errors["triton"])[steps // 2],
            "reference_bf16_max_relative_error": max(errors["reference"]), "greedy_agreement": agree / (steps * batch)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["small-0.6b", "llama-1b"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--no-reference", action="store_true", help="skip the reference ops' timing")
    parser.add_argument("--bf16-bound", type=int, default=0, metavar="STEPS", help="teacher-forced steps (0: skip)")
    parser.add_argument("--out", default="decode_step.json")
    args = parser.parse_args()
    device = open_device()
    provider = TritonOps()
    with_pdl = provider.load(device, pdl=True)
    op_sets = {"triton": reference_ops().with_provider("triton", provider.load(device)),
               "triton+pdl": reference_ops().with_provider("triton", with_pdl),
               # PDL on the projections only: the attention launched plainly
               "triton+pdl-attn": reference_ops().with_provider("triton", {
                   **with_pdl, "paged_attention": provider.load(device)["paged_attention"]})}
    if not args.no_reference:
        op_sets = {"reference": reference_ops(), **op_sets}
    rows: list[dict[str, Any]] = []
    for name in args.models:
        model = load(name, args.dtype, device)
        live = -(-(args.context + 8) // BLOCK) * BLOCK  # the block table must hold each row's context
        if model.shape.max_model_len < live:
            model = load(name, args.dtype, device, f"model.max_model_len={live}")
        for batch in args.batch:
            results = {}
            for label, ops in op_sets.items():
                inputs, cache = step_inputs(model, batch, args.context)
                results[label] = replay(model, ops, inputs, cache, args.replays)
            row = {"model": name, "batch": batch, "context": args.context, "dtype": args.dtype,
                   **{f"{label}_us": r["us_per_step"] for label, r in results.items()},
                   **{f"{label}_same": r["replays_identical"] for label, r in results.items()},
                   "pdl_equals_plain": bool(torch.equal(results["triton"]["logits"], results["triton+pdl"]["logits"]))}
            if "reference" in results:
                row["error_vs_reference"] = relative_error(results["triton"]["logits"], results["reference"]["logits"])
            rows.append(row)
            print(json.dumps(row), flush=True)
        del model
        torch.cuda.empty_cache()
    bounds = [bf16_bound(name, device, args.bf16_bound, 8, args.context) for name in args.models] if args.bf16_bound \
        else []
    with open(args.out, "w") as out:
        json.dump({"steps": rows, "bf16_bound": bounds}, out, indent=2)
    labels = list(op_sets)
    print(f"{'model':>11} {'bs':>4} " + " ".join(f"{label + ' µs':>16}" for label in labels)
          + f" {'same':>5} {'pdl=':>5} {'err':>8}")
    for r in rows:
        same = "".join(str(r[f"{label}_same"])[0] for label in labels)
        print(f"{r['model']:>11} {r['batch']:>4} " + " ".join(f"{r[label + '_us']:>16.1f}" for label in labels)
              + f" {same:>5} {str(r['pdl_equals_plain'])[0]:>5} {r.get('error_vs_reference', float('nan')):>8.1e}")
    for b in bounds:
        print(f"bf16 vs fp32 {b['model']}: max rel err {b['max_relative_error']:.2e} (median "
              f"{b['median_relative_error']:.2e}; bf16 reference ops {b['reference_bf16_max_relative_error']:.2e}) "
              f"over {b['steps']} steps x {b['batch']}, greedy agree {100 * b['greedy_agreement']:.1f} %")


if __name__ == "__main__":
    main()
