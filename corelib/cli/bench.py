"""`python -m corelib bench`: sweep batch size, handoff, transport, materialization and backend.

Every point runs in this one process, one after another, so every ratio in the table is
measured side by side. One engine is built per (backend, transport, materialization,
handoff) and reused across batch sizes; each batch size first runs a warm-up round.
A point decodes ``batch_size`` requests of ``prompt_len`` tokens for ``output_len`` new
tokens each (EOS ignored), so every decode step has exactly ``batch_size`` sequences; each
batch size is also a decode graph bucket of the engine (beside ``engine.graph_batch_sizes``).

Where the workload says how requests arrive (``workload.request_rate``,
``workload.max_concurrency`` or ``workload.dataset``), every engine also serves that workload,
as ``run`` would, and a second table gives its TTFT, TPOT and throughput side by side.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from corelib.cli.bench_prompts import PromptPoint, measure_prompts, prompt_table
from corelib.cli.bench_serving import ServePoint, serve, serve_table, wants_serving
from corelib.engine.api import Engine
from corelib.engine.sequence import SamplingParams
from corelib.errors import ConfigError
from corelib.observe.rundir import RunDir
from corelib.plugins import PluginRegistry
from corelib.sampling_params import SamplingError
from corelib.startup.compose import compose_config
from corelib.startup.start import Startup, start
from corelib.support.progress import say, show
from corelib.support.stats import percentile

#: the slowest SHM hops a point keeps in bench.json, with where they fell
SLOWEST_HOPS = 5


@dataclass
class BenchPoint:
    backend: str
    runtime: str
    tp: int
    transport: str
    materialization: str
    handoff: str
    batch_size: int
    tpot_ms: float
    ops: str  # who runs the ops: "reference", or the provider's name
    pdl: bool  # the provider's kernels were launched with programmatic dependent launch
    tokens_per_s: float
    occupancy: float | None
    idle_gap_median_us: float | None
    decode_steps: int
    steps_async: int
    repeats_tpot_ms: list[float] = field(default_factory=list)
    # shm: from the producer's stamp, taken before it builds the frame's header (or the worker ready, if later), to
    # the inputs ready there
    transport_us_p50: float | None = None
    transport_us_p99: float | None = None
    # Of each hop, the part until the frame was in the worker's hands (the producer's commit, the doorbell, the
    # worker's wake-up and the ring's read: "wake-up" for short); the rest is the worker's parse and staging
    transport_wake_us_p50: float | None = None
    transport_wake_us_p99: float | None = None
    # The point's slowest hops, slowest first: [the step's place among the point's steps (0: the first after the
    # warm-up), µs, its wake-up part µs (-1: not known)]; whether a tail is the first steps of a batch or spread over
    # the run, and whether it was the wake-up or the staging.
    transport_us_slowest: list[list[float]] = field(default_factory=list)
    # The scheduler side's own work per decode step (median µs): schedule + pack + post-process, and each part.
    host_us: float | None = None
    host_schedule_us: float | None = None
    host_pack_us: float | None = None
    host_postprocess_us: float | None = None
    # tp > 1: the decode graphs' all-reduces ran through symmetric memory (else the collective library)
    fast_allreduce: bool = False


def _overrides(cfg: DictConfig) -> list[str]:
    """The overrides this bench was started with, minus the bench's own and hydra's."""
    from hydra.core.hydra_config import HydraConfig

    try:
        task = list(HydraConfig.get().overrides.task)
    except ValueError:
        task = []
    return [o for o in task if not o.startswith(("bench", "hydra.", "engine.async_token_handoff=", "engine.tp=",
                                                   "engine.transport=", "engine.shm.materialization=",
                                                   "engine.fused_ops=", "engine.pdl=", "engine.fast_allreduce="))]


def decode_graph_sizes(configured: Sequence[int], batch_sizes: Sequence[int]) -> list[int]:
    """The decode graph buckets a bench engine captures: the configured ones and every batch size measured, so
    that a point past the largest configured bucket (bs 128 against buckets up to 64) replays a graph of its own
    size rather than running its steps eagerly."""
    return sorted({*configured, *batch_sizes})


def _measure(engine: Engine, batch_size: int, prompt_len: int, sampling: SamplingParams, seed: int
             ) -> tuple[float, float]:
    """(median TPOT ms, output tokens/s) for one batch decoded to the end."""
    vocab = engine.vocab_size
    prompts = [[(seed * 7919 + i * 131 + j * 17) % (vocab - 2) + 2 for j in range(prompt_len)]
               for i in range(batch_size)]
    output_len = sampling.max_tokens or 0
    start = time.perf_counter()
    outputs = engine.generate(prompts, sampling)
    wall = time.perf_counter() - start
    tpots = [o.tpot_ms for o in outputs if o.tpot_ms is not None]
    return statistics.median(tpots), batch_size * output_len / wall


def bench(cfg: DictConfig, registry: PluginRegistry, run_dir: RunDir, console: Console) -> list[BenchPoint]:
    spec = cfg.bench
    base = _overrides(cfg)
    try:  # the decode points' sampling, checked before any engine starts
        timed = SamplingParams(max_tokens=spec.output_len, ignore_eos=True, temperature=spec.temperature,
                               top_p=spec.top_p, seed=0)
        warm = timed.replace(max_tokens=max(spec.warmup_steps, 2))
    except SamplingError as error:
        raise ConfigError(f"bench.{error}") from None
    drawn = f" temperature={spec.temperature:g} top_p={spec.top_p:g}" if spec.temperature > 0 else ""
    backends = list(spec.backends) or [None]
    points: list[BenchPoint] = []
    served: list[ServePoint] = []
    prompted: list[PromptPoint] = []
    largest = max(spec.batch_sizes)
    seen: set[tuple[object, ...]] = set()
    devices: list[str] = []
    for backend, fused, pdl, tp, allreduce_mode, requested, asked, handoff in itertools.product(
        backends, spec.fused_ops, spec.pdl, spec.tp, spec.fast_allreduce, spec.transport, spec.materialization,
        spec.handoff
    ):
        transport = "shm" if tp > 1 else requested  # ranks are worker processes fed over shm
        materialization = asked if transport == "shm" else "auto"  # it only matters for shm
        allreduce = allreduce_mode if tp > 1 else "auto"  # one rank: no all-reduce to choose
        key = (backend, fused, pdl, tp, allreduce, transport, materialization, handoff)
        if key in seen:
            continue
        seen.add(key)
        overrides = [
            *base,
            *([f"backend={backend}"] if backend else []),
            f"engine.tp={tp}",
            f"engine.transport={transport}",
            f"engine.shm.materialization={materialization}",
            f"engine.async_token_handoff={handoff}",
            f"engine.fused_ops={fused}",
            f"engine.pdl={pdl}",
            f"engine.fast_allreduce={allreduce}",
            f"engine.max_num_seqs={max(largest, 1, *spec.prompt_counts)}",
            f"engine.graph_batch_sizes={decode_graph_sizes(cfg.engine.graph_batch_sizes, spec.batch_sizes)}",
            f"engine.max_num_batched_tokens={max(largest * spec.prompt_len, cfg.engine.max_num_batched_tokens)}",
        ]
        try:
            startup = start(compose_config(overrides), registry)
        except ConfigError as error:
            say(console, f"bench: skipping {backend or 'default'}/{transport}/{materialization}/{handoff}: {error}")
            continue
        devices.extend(startup.messages)
        ops = _ops_label(startup)
        with Engine(startup) as engine:
            label = (f"{startup.spec.backend}/{startup.spec.runtime.value} tp={tp}{_allreduce_note(startup)} "
                     f"{transport} {engine.materialization} handoff={handoff} ops={ops} pdl={_on(startup.options.pdl)}"
                     f"{drawn}")
            for batch_size in spec.batch_sizes:
                _measure(engine, batch_size, spec.prompt_len, warm, seed=1)
                first_step = engine.stats().num_steps
                repeats = [_measure(engine, batch_size, spec.prompt_len, timed, seed=2 + r)
                           for r in range(spec.repeats)]
                stats = engine.stats(since_step=first_step)
                device, steps = stats.device, stats.steps
                hops = [(at, s.transport_us, -1.0 if s.wake_us is None else s.wake_us)
                        for at, s in enumerate(steps) if s.transport_us is not None]
                transport_us = [us for _, us, _ in hops]
                wake_us = [wake for _, _, wake in hops if wake >= 0]
                host = [s.host for s in steps if s.host is not None and s.kind.value == "decode"]
                tpot = statistics.median(r[0] for r in repeats)
                point = BenchPoint(
                    backend=startup.spec.backend,
                    runtime=startup.spec.runtime.value,
                    tp=tp,
                    transport=transport,
                    materialization=engine.materialization,
                    handoff="on" if engine.async_handoff else "off",
                    batch_size=batch_size,
                    tpot_ms=tpot,
                    ops=ops,
                    pdl=startup.options.pdl,
                    tokens_per_s=statistics.median(r[1] for r in repeats),
                    occupancy=device["occupancy"],
                    idle_gap_median_us=device["idle_gap_median_us"],
                    decode_steps=sum(1 for s in steps if s.kind.value == "decode"),
                    steps_async=sum(1 for s in steps if s.path == "async"),
                    repeats_tpot_ms=[r[0] for r in repeats],
                    transport_us_p50=percentile(transport_us, 50),
                    transport_us_p99=percentile(transport_us, 99),
                    transport_wake_us_p50=percentile(wake_us, 50),
                    transport_wake_us_p99=percentile(wake_us, 99),
                    transport_us_slowest=[[at, us, wake] for at, us, wake in
                                          sorted(hops, key=lambda hop: -hop[1])[:SLOWEST_HOPS]],
                    host_us=percentile([h.total_us for h in host], 50),
                    host_schedule_us=percentile([h.schedule_us for h in host], 50),
                    host_pack_us=percentile([h.pack_us for h in host], 50),
                    host_postprocess_us=percentile([h.postprocess_us for h in host], 50),
                    fast_allreduce=startup.options.fast_allreduce,
                )
                points.append(point)
                say(console, f"bench {label} bs={batch_size}: TPOT {tpot:.3f} ms{_host_note(point)}"
                             f"{_transport_note(point)}")
            for length, count in itertools.product(spec.prompt_lens, spec.prompt_counts):
                if length >= startup.config.model.max_model_len:
                    say(console, f"bench: skipping {count} x {length} prompt tokens: model.max_model_len="
                                 f"{startup.config.model.max_model_len} leaves no room for a new token")
                    continue
                prompted.append(measure_prompts(engine, label, length, count, spec.repeats))
                say(console, f"bench {label}: {count} x {length} prompt tokens, first tokens in "
                             f"{prompted[-1].ttft_ms:.2f} ms")
            if wants_serving(startup.config.workload):
                served.append(serve(engine, startup.config.workload, label))
                say(console, f"bench {label}: served the workload in {served[-1].wall_s:.2f} s")
    show(console, bench_table(points))
    if prompted:
        show(console, prompt_table(prompted))
    if served:
        show(console, serve_table(served))
    payload = {
        "machine": _machine(devices),
        "overrides": base,
        "bench": {k: list(v) if isinstance(v, list | tuple) else v for k, v in dict(spec).items()},
        "points": [asdict(p) for p in points],
        "ratios": ratios(points),
        "served": [asdict(p) for p in served],
        "prompts": [asdict(p) for p in prompted],
    }
    run_dir.write_file("bench.json", json.dumps(payload, indent=2, default=str) + "\n")
    say(console, f"wrote {run_dir.path / 'bench.json'}")
    return points


def _host_note(point: BenchPoint) -> str:
    """The scheduler side's work per decode step (schedule + pack + post-process)."""
    if point.host_us is None:
        return ""
    return (f", host {point.host_us:.0f} µs/step (schedule {point.host_schedule_us or 0:.0f}, pack "
            f"{point.host_pack_us or 0:.0f}, post-process {point.host_postprocess_us or 0:.0f})")


def _transport_note(point: BenchPoint) -> str:
    """The SHM hop (producer commit to inputs staged in the worker), where there is one."""
    if point.transport_us_p50 is None:
        return ""
    wake = ("" if point.transport_wake_us_p50 is None else
            f" (wake-up p50 {point.transport_wake_us_p50:.0f} p99 {point.transport_wake_us_p99 or 0:.0f})")
    return f", transport p50 {point.transport_us_p50:.0f} µs p99 {point.transport_us_p99 or 0:.0f} µs{wake}"


def _allreduce_note(startup: Startup) -> str:
    """tp > 1: which all-reduce the graphs run (symmetric memory, or the collective library)."""
    if startup.options.tp < 2:
        return ""
    return " symm" if startup.options.fast_allreduce else " lib"


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _ops_label(startup: Startup) -> str:
    fused = startup.options.fused_ops
    provider = startup.backend.op_provider()
    return "reference" if not fused or provider is None else provider.name


def ratios(points: list[BenchPoint]) -> list[dict[str, Any]]:
    """Async/sync TPOT at equal everything else, from the same run."""
    out = []
    index = {(p.backend, p.ops, p.pdl, p.tp, p.fast_allreduce, p.transport, p.materialization, p.handoff,
              p.batch_size): p for p in points}
    for (backend, ops, pdl, tp, symm, transport, materialization, handoff, batch_size), point in index.items():
        if handoff != "on":
            continue
        sync = index.get((backend, ops, pdl, tp, symm, transport, materialization, "off", batch_size))
        if sync is not None:
            out.append({"backend": backend, "ops": ops, "pdl": pdl, "tp": tp, "fast_allreduce": symm,
                        "transport": transport, "materialization": materialization, "batch_size": batch_size,
                        "async_over_sync_tpot": point.tpot_ms / sync.tpot_ms})
    return out


def bench_table(points: list[BenchPoint]) -> Table:
    table = Table(title="corelib bench (one process, side by side)")
    for column in ("backend", "ops", "pdl", "tp", "transport", "mat.", "handoff", "bs", "TPOT ms", "tok/s",
                   "occupancy", "gap µs", "host µs/step", "xport µs p50/p99", "async/sync"):
        table.add_column(column, justify="right")
    ratio = {(r["backend"], r["ops"], r["pdl"], r["tp"], r["fast_allreduce"], r["transport"], r["materialization"],
              r["batch_size"]): r["async_over_sync_tpot"] for r in ratios(points)}
    for p in points:
        key = (p.backend, p.ops, p.pdl, p.tp, p.fast_allreduce, p.transport, p.materialization, p.batch_size)
        r = ratio.get(key) if p.handoff == "on" else None
        xport = "-" if p.transport_us_p50 is None else f"{p.transport_us_p50:.0f}/{p.transport_us_p99 or 0:.0f}"
        table.add_row(
            f"{p.backend}/{p.runtime}", p.ops, _on(p.pdl),
            str(p.tp) + ("" if p.tp < 2 else " symm" if p.fast_allreduce else " lib"), p.transport,
            p.materialization, p.handoff,
            str(p.batch_size),
            f"{p.tpot_ms:.3f}", f"{p.tokens_per_s:.0f}",
            "-" if p.occupancy is None else f"{100 * p.occupancy:.1f} %",
            "-" if p.idle_gap_median_us is None else f"{p.idle_gap_median_us:.1f}",
            "-" if p.host_us is None else f"{p.host_us:.0f}",
            xport,
            "-" if r is None else f"{r:.3f}",
        )
    return table


def _machine(devices: list[str]) -> dict[str, Any]:
    """Where the figures come from: the host, torch, and what each backend said about its device."""
    return {
        "date": time.strftime("%Y-%m-%d"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "devices": sorted(set(devices)),
    }
