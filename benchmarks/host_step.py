"""The scheduler side's work per decode step, alone: schedule, pack and post-process at bs 1..256.

The request loop runs around an executor that answers every step at once (no device, no
model), so each step costs only the host's own work; each phase is timed around its call and
the median over the decode steps is printed per batch size, with calls per step (a CPU
profile of the same loop names where they go: ``--profile BS``).

``--mixed``: the same for the step of benchmarks/mixed_step.py part 1 (32 decode rows beside
512-token chunks of 1,500-token prompts, padded to the 512-token bucket, prefix caching on)
against the decode-only steps of the same 32 rows: each phase as the step records it
(``HostTime``), per step the least over ``--repeats`` runs of the same steps (the same work
each run: the least is what the step costs without the machine's noise), then the median over
the steps (``--profile-mixed``: a CPU profile of the mixed steps).

    python3 benchmarks/host_step.py [--batch-sizes 1 8 64 128 256] [--steps 128] [--profile 128]
    python3 benchmarks/host_step.py --mixed [--repeats 8]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import io
import json
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

from corelib.config.options import StepCheck
from corelib.engine.core import EngineCore
from corelib.engine.sequence import SamplingParams, Sequence
from corelib.observe.metrics import HostTime
from corelib.plugins import PluginRegistry
from corelib.startup.compose import compose_config
from corelib.startup.start import start
from corelib.testing.executor import instant_core, unit_config, unit_options

PHASES = ("schedule", "pack", "postprocess")


@functools.cache
def gate_check() -> StepCheck:
    """The async gate's per-step requirements as startup reads them from conf/features (emulated npu)."""
    return start(compose_config(["backend=npu", "engine.async_token_handoff=on"]), PluginRegistry()).options.step_check


def build(batch: int, steps: int) -> EngineCore:
    """An async (one step ahead) loop with graphs' padding, small-0.6b's vocabulary, ``batch`` requests."""
    config = unit_config(max_num_seqs=batch, block_size=16, max_model_len=64 + steps, vocab_size=151936)
    config.engine.graph_batch_sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= batch] or [1]
    config.engine.max_num_batched_tokens = max(2048, 32 * batch)
    options = dataclasses.replace(unit_options(run_ahead=1, step_check=gate_check()), graphs=True)
    core, _ = instant_core(config, options)
    add = getattr(core, "add", core.scheduler.add)  # (a loop without the core's add: the scheduler's)
    for number in range(batch):
        prompt = [(number * 131 + j * 17) % 150000 + 2 for j in range(32)]
        add(Sequence(number, f"r{number}", prompt, SamplingParams(max_tokens=steps, ignore_eos=True)))
    return core


def _timed(record: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append((time.perf_counter() - started) * 1e6)

    return wrapper


def measure(batch: int, steps: int) -> dict[str, float]:
    core = build(batch, steps)
    for _ in range(4):  # the prefill and the first decode steps: the pipeline full
        core.iterate()
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    scheduler, builder = core.scheduler, core.builder
    scheduler.schedule = _timed(times["schedule"], scheduler.schedule)  # type: ignore[method-assign]
    builder.fill = _timed(times["pack"], builder.fill)  # type: ignore[method-assign]
    scheduler.postprocess = _timed(times["postprocess"], scheduler.postprocess)  # type: ignore[method-assign]
    started = time.perf_counter()
    count = 0
    while core.iterate():
        count += 1
    wall = (time.perf_counter() - started) * 1e6 / max(count, 1)
    row = {phase: statistics.median(values[1:-2] or values) for phase, values in times.items()}
    row["host"] = sum(row[phase] for phase in PHASES)
    row["loop"] = wall
    return row


def profile(batch: int, steps: int, top: int = 18) -> str:
    core = build(batch, steps)
    for _ in range(4):
        core.iterate()
    profiler = cProfile.Profile()
    profiler.enable()
    while core.iterate():
        pass
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def build_mixed(decoders: int, budget: int) -> EngineCore:
    """mixed_step.py's engine on the instant executor: chunked prefill under ``budget`` tokens, steps with prompt
    tokens padded to their token bucket, prefix caching, one step ahead, small-0.6b's vocabulary."""
    config = unit_config(max_num_seqs=decoders + 8, block_size=16, max_model_len=4096, vocab_size=151936)
    config.engine.max_num_batched_tokens = budget
    options = dataclasses.replace(
        unit_options(run_ahead=1, step_check=gate_check()),
        graphs=True,
        mixed_graphs=True,
        chunked_prefill=True,
        prefix_caching=True,
    )
    core, _ = instant_core(config, options)
    return core


def mixed_run(args: argparse.Namespace, profiler: cProfile.Profile | None = None) -> dict[str, list[HostTime]]:
    """One run: the decoders' decode-only steps, then rounds of ``--prompts`` prompts fed in chunks beside them."""
    core = build_mixed(args.decoders, args.budget)
    number = 0

    def add(length: int, seed: int, max_tokens: int) -> None:
        nonlocal number
        prompt = [(seed * 7919 + j * 31 + j * j) % 151934 + 2 for j in range(length)]
        core.add(Sequence(number, f"r{number}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        number += 1

    for i in range(args.decoders):
        add(16, 10_000 + i, 3500)
    for _ in range(8):  # their prompts done: decode steps alone
        core.iterate()
    first = core.metrics.num_steps
    for _ in range(24):
        core.iterate()
    decode = [r.host for r in core.metrics.steps_since(first)[1:-1] if r.host is not None]
    mixed: list[HostTime] = []
    for round_ in range(args.rounds):
        for i in range(args.prompts):
            add(args.prompt, 100 * round_ + i, 4)
        first = core.metrics.num_steps
        if profiler is not None:
            profiler.enable()
        for _ in range(args.mixed_steps):
            core.iterate()
        if profiler is not None:
            profiler.disable()
        mixed += [
            r.host for r in core.metrics.steps_since(first) if r.host is not None and r.num_tokens > args.decoders
        ]
    return {"decode": decode, "mixed": mixed}


def measure_mixed(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Per phase: each step's least over the runs, then the median over the steps (decode-only and mixed)."""
    runs = [mixed_run(args) for _ in range(args.repeats)]
    out: dict[str, dict[str, float]] = {}
    for kind in ("decode", "mixed"):
        steps = list(zip(*(run[kind] for run in runs), strict=False))
        row = {
            phase: statistics.median(min(getattr(h, f"{phase}_us") for h in step) for step in steps) for phase in PHASES
        }
        row["host"] = row["schedule"] + row["pack"] + row["postprocess"]
        row["steps"] = len(steps)
        out[kind] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--steps", type=int, default=128, help="decode steps per batch size")
    parser.add_argument("--repeats", type=int, default=3, help="runs per batch size; the median is printed")
    parser.add_argument("--profile", type=int, default=0, help="also print a CPU profile at this batch size")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--mixed", action="store_true", help="the mixed step of mixed_step.py against decode-only")
    parser.add_argument("--profile-mixed", action="store_true", help="also print a CPU profile of the mixed steps")
    parser.add_argument("--decoders", type=int, default=32, help="--mixed: decoding requests")
    parser.add_argument("--prompt", type=int, default=1500, help="--mixed: tokens of each arriving prompt")
    parser.add_argument("--prompts", type=int, default=4, help="--mixed: prompts per round")
    parser.add_argument("--budget", type=int, default=512, help="--mixed: engine.max_num_batched_tokens")
    parser.add_argument("--rounds", type=int, default=4, help="--mixed: rounds of prompts per run")
    parser.add_argument("--mixed-steps", type=int, default=13, help="--mixed: steps per round")
    args = parser.parse_args()
    if args.mixed:
        table = measure_mixed(args)
        print(f"µs per step, the least of {args.repeats} runs, the median over the steps")
        print(f"{'step':>28} {'schedule':>9} {'pack':>9} {'post':>9} {'host':>9}")
        for kind, row in table.items():
            label = f"{args.decoders} decode rows" + (f" + {args.budget}-token chunks" if kind == "mixed" else "")
            print(f"{label:>28} " + " ".join(f"{row[k]:>9.1f}" for k in (*PHASES, "host")), flush=True)
        if args.out:
            with open(args.out, "w") as out:
                json.dump(table, out, indent=2)
        if args.profile_mixed:
            profiler = cProfile.Profile()
            mixed_run(args, profiler)
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
            print(text.getvalue())
        return
    rows = []
    print("medians per decode step, µs")
    print(f"{'bs':>4} {'schedule':>9} {'pack':>9} {'post':>9} {'host':>9} {'loop':>9}")
    for batch in args.batch_sizes:
        runs = [measure(batch, args.steps) for _ in range(args.repeats)]
        row = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        rows.append({"batch_size": batch, **row})
        print(f"{batch:>4} " + " ".join(f"{row[k]:>9.1f}" for k in (*PHASES, "host", "loop")), flush=True)
    if args.out:
        with open(args.out, "w") as out:
            json.dump(rows, out, indent=2)
    if args.profile:
        print(profile(args.profile, args.steps))


if __name__ == "__main__":
    main()
