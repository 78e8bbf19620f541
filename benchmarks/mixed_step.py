"""Where a step that carries prompt tokens spends its time, measured without a profiler, with its
graphs (engine.mixed_graphs=on) and without (off), in one process.

1. Mixed steps: decoders run, then long prompts arrive and are fed in chunks of the token budget
   beside them. Each step's wall time is taken with the device synchronized after it; the device
   time is the step's own (its start and end events); the host's share is the difference. The
   first mixed steps of each kind are reported apart: a kernel compiled for a new token count
   shows there. Of the host's share, the scheduler side's part before the step's device work
   starts (choosing the batch, packing it) is each step's record (``HostTime``, µs), beside its
   post-process (which runs while the next step's device work does).
2. Where the eager host time goes (without graphs): the wall time of the step's Python on the
   host (engine.step() without a synchronization, the device still running), the launches it
   makes (torch's and Triton's, counted by wrapping their entry points) and the time per launch.
3. Stalls: prompts of random lengths arrive for ``--stall-seconds`` while the decoders run; every
   step's wall time, grouped by its token bucket: the median and the worst against it.
4. Time to first token for prompts of ``--prompt-lens`` x ``--prompt-counts`` tokens, and
   transformers' eager forward on the same shapes and weights (``--transformers``).
5. ``--profile N``: the kernels of N more mixed steps under torch's profiler (inside the replayed
   graphs, with them on), µs per call, calls and ms per step, by kernel.

    python3 benchmarks/mixed_step.py model=small-0.6b backend=cuda --out mixed.json
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from corelib.engine import Engine, SamplingParams
from corelib.models.random_init import random_state_dict
from corelib.models.registry import model_shape
from corelib.support.heap import freeze_startup_heap

Json = dict[str, Any]
PHASES = ("schedule", "pack", "postprocess")  # the scheduler side's work per step (its record's HostTime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--decoders", type=int, default=32)
    parser.add_argument("--decoder-tokens", type=int, default=3500, help="tokens each decoder decodes")
    parser.add_argument("--prompt", type=int, default=1500, help="tokens of each arriving prompt (part 1)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--budget", type=int, default=512, help="engine.max_num_batched_tokens of part 1")
    parser.add_argument("--steps", type=int, default=12, help="mixed steps timed per mode")
    parser.add_argument("--stall-seconds", type=float, default=0.0, help="part 3 (0: skipped)")
    parser.add_argument("--stall-progress", default=None, help="part 3's table so far, rewritten every 15 s")
    parser.add_argument("--prompt-lens", type=int, nargs="*", default=[500, 2000])
    parser.add_argument("--prompt-counts", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--transformers", action="store_true", help="transformers' eager forward on part 4's shapes")
    parser.add_argument("--modes", nargs="*", default=["off", "on"], help="engine.mixed_graphs values compared")
    parser.add_argument("--profile", type=int, default=0, help="mixed steps profiled per mode (part 5; 0: none)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result: Json = {"settings": vars(args), "modes": {}}
    for mode in args.modes:
        result["modes"][mode] = run_mode(args, mode)
    if args.transformers:
        result["transformers"] = transformers_prefill(args)
    print(summary(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")


def engine_for(args: argparse.Namespace, mode: str, budget: int, rows: int) -> Engine:
    return Engine.from_overrides([*args.overrides, "engine.chunked_prefill=on", f"engine.mixed_graphs={mode}",
                                  f"engine.max_num_batched_tokens={budget}", f"engine.max_num_seqs={rows}",
                                  "model.max_model_len=4096"])


def run_mode(args: argparse.Namespace, mode: str) -> Json:
    out: Json = {}
    rows = args.decoders + args.prompts * 2
    started = time.perf_counter()
    with engine_for(args, mode, args.budget, rows) as engine:
        out["startup_s"] = time.perf_counter() - started
        out["graphs"] = None if engine.graphs is None else engine.graphs.describe()
        decoders = start_decoders(engine, args.decoders, args.decoder_tokens)
        out["decode"] = timed_steps(engine, 16)
        for round_ in range(2):  # the first round meets every kernel for the first time; the second does not
            for i in range(args.prompts):
                engine.add_request(prompt(engine, args.prompt, seed=100 * round_ + i),
                                   SamplingParams(max_tokens=4, ignore_eos=True))
            out[f"mixed_round{round_}"] = timed_steps(engine, args.steps)
        if args.profile:
            out["profile"] = profile_kernels(engine, args)
        if mode == "off":
            out["eager_host"] = eager_host(engine, args)
        if args.stall_seconds:
            out["stalls"] = stalls(engine, args, decoders)
    with engine_for(args, mode, max(2048, max(args.prompt_lens, default=0)), max(args.prompt_counts, default=1)) \
            as engine:
        out["ttft"] = [ttft(engine, length, count) for length in args.prompt_lens for count in args.prompt_counts]
    return out


def start_decoders(engine: Engine, count: int, tokens: int) -> set[str]:
    """``count`` requests that decode ``tokens`` tokens each, their prompts done; their ids."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    ids = {engine.add_request(prompt(engine, 16, seed=10_000 + i), params) for i in range(count)}
    for _ in range(8):  # their prompts done: decode steps alone
        engine.step()
    return ids


def prompt(engine: Engine, length: int, seed: int) -> list[int]:
    vocab = engine.vocab_size
    return [(seed * 7919 + j * 31 + j * j) % (vocab - 2) + 2 for j in range(length)]


def timed_steps(engine: Engine, steps: int) -> Json:
    """Wall (device synchronized after each), device and host ms of ``steps`` steps, their tokens, and the scheduler
    side's µs per phase (each step's record)."""
    stats = engine.stats()
    first, ahead = stats.num_steps, stats.num_in_flight  # steps submitted before the timed ones, read first
    walls = []
    for _ in range(steps):
        began = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - began) * 1e3)
    for _ in range(max(ahead, 1)):  # the last timed steps' records are read by the next steps
        engine.step()
    records = engine.stats(since_step=first).steps[ahead : ahead + steps]
    device = [r.busy_ms for r in records if r.busy_ms is not None]
    host = {
        f"{phase}_us": [None if r.host is None else getattr(r.host, f"{phase}_us") for r in records] for phase in PHASES
    }
    return {"wall_ms": walls, "device_ms": device, "kinds": [r.kind.value for r in records],
            "graph": [r.graph for r in records], "wall_ms_median": statistics.median(walls),
            "device_ms_median": statistics.median(device) if device else None, **host}


def host_phases(r: Json, kinds: set[str]) -> str:
    """The median µs of each phase over the steps of ``kinds``, as a summary's words."""
    chosen = [i for i, kind in enumerate(r["kinds"]) if kind in kinds]
    words = []
    for phase in PHASES:
        column = r.get(f"{phase}_us") or []
        values = [column[i] for i in chosen if i < len(column) and column[i] is not None]
        words.append(f"{phase} {statistics.median(values):.0f}" if values else f"{phase} -")
    return ", ".join(words) + " µs"


def eager_host(engine: Engine, args: argparse.Namespace) -> Json:
    """Mixed steps without graphs: the host's Python per step, and the launches it makes."""
    import triton

    counts: dict[str, int] = defaultdict(int)
    wrapped: list[tuple[Any, str, Any]] = []

    def counting(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def call(*a: Any, **k: Any) -> Any:
            counts[label] += 1
            return original(*a, **k)

        wrapped.append((owner, name, original))
        setattr(owner, name, call)

    counting(triton.runtime.jit.JITFunction, "run", "triton")
    counting(torch.nn.functional, "linear", "cublas (F.linear)")
    counting(torch, "addmm", "cublas (addmm)")
    for i in range(args.prompts):
        engine.add_request(prompt(engine, args.prompt, seed=500 + i), SamplingParams(max_tokens=4, ignore_eos=True))
    host = []
    try:
        for _ in range(args.steps):
            torch.cuda.synchronize()
            began = time.perf_counter()
            engine.step()  # returns once the step is submitted (and the previous one read): the host's part
            host.append((time.perf_counter() - began) * 1e3)
    finally:
        for owner, name, original in wrapped:
            setattr(owner, name, original)
    per_step = {label: count / args.steps for label, count in counts.items()}
    return {"host_ms": host, "host_ms_median": statistics.median(host), "launches_per_step": per_step}


def profile_kernels(engine: Engine, args: argparse.Namespace) -> Json:
    """The device kernels of ``args.profile`` mixed steps (fresh prompts beside the decoders), by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(args.prompts):
        engine.add_request(prompt(engine, args.prompt, seed=700 + i), SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(2):  # into the chunks' steady state
        engine.step()
    torch.cuda.synchronize()
    first = engine.stats().num_steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.profile):
            engine.step()
            torch.cuda.synchronize()
    kinds = [r.kind.value for r in engine.stats(since_step=first).steps]
    steps = max(1, sum(1 for kind in kinds if kind != "decode"))
    kernels = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0.0)
        if event.device_type.name == "CUDA" and device_us > 0:
            kernels.append({"kernel": event.key, "calls_per_step": event.count / args.profile,
                            "us_per_call": device_us / event.count, "ms_per_step": device_us / args.profile / 1e3})
    kernels.sort(key=lambda k: -k["ms_per_step"])
    return {"steps": args.profile, "mixed_steps": steps, "kernels": kernels}


def stalls(engine: Engine, args: argparse.Namespace, decoders: set[str]) -> Json:
    """Prompts of random lengths arrive while the decoders run, for ``args.stall_seconds``: each step's wall time
    (the device synchronized after it) by the token bucket of the step it submitted, the median and the worst
    against it. A decoder that finishes is replaced, so the batch stays full however long the run. As the server
    does once it is up, the objects of startup are frozen out of the garbage collector's passes first, and each
    slow step names the passes made during it. With ``--stall-progress FILE`` the table so far is written there
    every 15 s (a run cut short still tells)."""
    rng = random.Random(7)
    buckets = engine.core.buckets
    by_bucket: dict[str, list[float]] = defaultdict(list)
    device_by_bucket: dict[str, list[float]] = defaultdict(list)
    slowest: list[Json] = []  # the slowest steps, for the note on any that stalls
    pending: dict[int, tuple[float, float, list[tuple[int, float]]]] = {}  # step id -> (wall ms, s into the run,
    # the garbage collector's passes during its call: generation, ms)
    decoder_params = SamplingParams(max_tokens=args.decoder_tokens, ignore_eos=True)
    arrival_params = SamplingParams(max_tokens=2, ignore_eos=True)
    seed, replaced = 20_000, 0
    decoders &= {seq.request_id for seq in engine.core.scheduler.unfinished()}  # those the earlier parts left
    while len(decoders) < args.decoders:
        seed += 1
        decoders.add(engine.add_request(prompt(engine, 16, seed), decoder_params))
    collected: list[tuple[int, float]] = []  # (generation, ms) of each collection during the current call
    collecting_since = [0.0]

    def on_collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collecting_since[0] = time.perf_counter()
        else:
            collected.append((info["generation"], (time.perf_counter() - collecting_since[0]) * 1e3))

    freeze_startup_heap()
    gc.callbacks.append(on_collection)
    began_run = time.perf_counter()
    deadline = began_run + args.stall_seconds
    next_progress = began_run + 15
    stats = engine.stats()
    seen = stats.num_steps
    while time.perf_counter() < deadline:
        if stats.num_waiting < 2:
            seed += 1
            engine.add_request(prompt(engine, rng.randint(1, 1800), seed), arrival_params)
        submitted = stats.num_steps + stats.num_in_flight  # the id of the step this call submits
        collected.clear()
        began = time.perf_counter()
        finished = engine.step()
        torch.cuda.synchronize()
        now = time.perf_counter()
        pending[submitted] = ((now - began) * 1e3, now - began_run, list(collected))
        for output in finished:  # a decoder done: another takes its place
            if output.request_id in decoders:
                decoders.discard(output.request_id)
                seed += 1
                decoders.add(engine.add_request(prompt(engine, 16, seed), decoder_params))
                replaced += 1
        stats = engine.stats(since_step=seen)
        for record in stats.steps:
            timed = pending.pop(record.step_id, None)
            if timed is None:
                continue
            wall, at, collections = timed
            bucket = (f"decode rows {record.num_seqs}" if record.kind.value == "decode"
                      else f"tokens {buckets.token_bucket(record.num_tokens) or 'eager'}")
            by_bucket[bucket].append(wall)
            if record.busy_ms is not None:
                device_by_bucket[bucket].append(record.busy_ms)
            slowest.append({"wall_ms": wall, "device_ms": record.busy_ms, "bucket": bucket, "at_s": at,
                            "step": record.step_id, "collections": collections})
            if len(slowest) > 64:
                slowest.sort(key=lambda s: -s["wall_ms"])
                del slowest[32:]
        seen = stats.num_steps
        if args.stall_progress and now > next_progress:
            next_progress = now + 15
            Path(args.stall_progress).write_text(json.dumps(
                stall_table(by_bucket, device_by_bucket, slowest, now - began_run, replaced), indent=1) + "\n")
    gc.callbacks.remove(on_collection)
    gc.unfreeze()
    return stall_table(by_bucket, device_by_bucket, slowest, time.perf_counter() - began_run, replaced)


def stall_table(by_bucket: dict[str, list[float]], device_by_bucket: dict[str, list[float]], slowest: list[Json],
                seconds: float, replaced: int) -> Json:
    """Per bucket: steps, median and worst wall ms, how many took over 3x the median; the slowest steps, each
    against its bucket's median wall and device time."""
    buckets = {}
    for key, walls in sorted(by_bucket.items()):
        median = statistics.median(walls)
        buckets[key] = {"steps": len(walls), "median_ms": median, "max_ms": max(walls),
                        "over_3x_median": sum(1 for w in walls if w > 3 * median),
                        "device_median_ms": statistics.median(device_by_bucket[key]) if device_by_bucket[key] else None}
    worst = sorted(slowest, key=lambda s: -s["wall_ms"])[:16]
    for step in worst:
        step["bucket_median_ms"] = buckets[step["bucket"]]["median_ms"]
    return {"seconds": seconds, "steps": sum(b["steps"] for b in buckets.values()), "decoders_replaced": replaced,
            "over_3x_median": sum(b["over_3x_median"] for b in buckets.values()), "buckets": buckets,
            "slowest": worst}


def ttft(engine: Engine, length: int, count: int) -> Json:
    """Time until every one of ``count`` fresh prompts of ``length`` tokens has its first token."""
    times = []
    for repeat in range(4):
        prompts = [prompt(engine, length, seed=1_000_000 + repeat * 100 + i) for i in range(count)]
        torch.cuda.synchronize()
        began = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        if repeat:  # the first is the warm-up
            times.append((time.perf_counter() - began) * 1e3)
    return {"length": length, "count": count, "ttft_ms": statistics.median(times), "repeats_ms": times,
            "prompt_tokens_per_s": length * count / statistics.median(times) * 1e3}


def transformers_prefill(args: argparse.Namespace) -> Json:
    """transformers' eager forward (no cache) on the prompt shapes of part 4, the same random weights."""
    sys.path.insert(0, str(Path(__file__).parent))
    hf_model = importlib.import_module("peers").hf_model  # a sibling script, not a package

    from corelib.plugins import PluginRegistry
    from corelib.startup.compose import compose_config, prepare_config_store

    prepare_config_store(PluginRegistry())
    config = compose_config(args.overrides)
    shape = model_shape(config.model)
    device = torch.device("cuda")
    state = {k: v.to(device=device, dtype=shape.dtype) for k, v in random_state_dict(shape, 0).items()}
    model = hf_model(shape, state, device)
    out = []
    for length in args.prompt_lens:
        for count in args.prompt_counts:
            ids = torch.randint(2, shape.vocab_size, (count, length), device=device)
            times = []
            with torch.inference_mode():
                for repeat in range(4):
                    torch.cuda.synchronize()
                    began = time.perf_counter()
                    model(input_ids=ids, use_cache=False, logits_to_keep=1)
                    torch.cuda.synchronize()
                    if repeat:
                        times.append((time.perf_counter() - began) * 1e3)
            out.append({"length": length, "count": count, "forward_ms": statistics.median(times)})
    return {"points": out}


def summary(result: Json) -> str:
    lines = []
    for mode, out in result["modes"].items():
        lines.append(f"== mixed_graphs={mode}: startup {out['startup_s']:.1f} s; {out['graphs'] or 'no graphs'}")
        lines.append(
            f"   decode steps: wall {out['decode']['wall_ms_median']:.3f} ms, device "
            f"{out['decode']['device_ms_median'] or 0:.3f} ms; host per step: "
            f"{host_phases(out['decode'], {'decode'})}"
        )
        for round_ in (0, 1):
            r = out[f"mixed_round{round_}"]
            mixed = [(w, d) for w, d, k in zip(r["wall_ms"], r["device_ms"], r["kinds"], strict=False) if k != "decode"]
            if mixed:
                walls = sorted(w for w, _ in mixed)
                device = statistics.median(d for _, d in mixed)
                wall = statistics.median(walls)
                lines.append(
                    f"   mixed steps, round {round_}: {len(mixed)}, wall median {wall:.2f} ms (max "
                    f"{walls[-1]:.2f}), device median {device:.2f} ms, host share {wall - device:.2f} ms; "
                    f"host per step: {host_phases(r, {'prefill'})}"
                )
        if "eager_host" in out:
            e = out["eager_host"]
            launches = ", ".join(f"{k} {v:.0f}" for k, v in e["launches_per_step"].items())
            lines.append(f"   eager host per mixed step (not synchronized): {e['host_ms_median']:.2f} ms; "
                         f"launches per step: {launches}")
        if "profile" in out:
            kernels = out["profile"]["kernels"]
            lines.append(f"   kernels of {out['profile']['steps']} steps ({out['profile']['mixed_steps']} mixed), "
                         f"{sum(k['ms_per_step'] for k in kernels):.2f} ms per step:")
            lines += [f"     {k['ms_per_step']:6.3f} ms  {k['calls_per_step']:6.1f} x {k['us_per_call']:7.1f} µs  "
                      f"{k['kernel'][:70]}" for k in kernels[:12]]
        if "stalls" in out:
            st = out["stalls"]
            lines.append(f"   stalls: {st['seconds']:.0f} s, {st['steps']} steps in {len(st['buckets'])} buckets, "
                         f"{st['decoders_replaced']} decoders replaced; over 3x their bucket's median: "
                         f"{st['over_3x_median']}")
            for key, s in st["buckets"].items():
                lines.append(f"     {key}: {s['steps']} steps, median {s['median_ms']:.2f} ms, max "
                             f"{s['max_ms']:.2f} ms, over 3x median: {s['over_3x_median']}")
            for s in st["slowest"][:8]:
                passes = ", ".join(f"gen {g} {ms:.1f} ms" for g, ms in s["collections"]) or "none"
                lines.append(f"     slow step {s['step']} at {s['at_s']:.0f} s: {s['wall_ms']:.2f} ms wall "
                             f"(device {s['device_ms'] or 0:.2f}), {s['bucket']} median {s['bucket_median_ms']:.2f}; "
                             f"garbage collections during it: {passes}")
        for t in out["ttft"]:
            lines.append(f"   TTFT {t['count']} x {t['length']}: {t['ttft_ms']:.2f} ms "
                         f"({t['prompt_tokens_per_s']:,.0f} prompt tokens/s)")
    for p in result.get("transformers", {}).get("points", []):
        lines.append(f"== transformers eager forward {p['count']} x {p['length']}: {p['forward_ms']:.2f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
