"""``bench``'s second table: each engine of the sweep serves the configured workload (arrivals,
concurrency, dataset) as ``run`` does, with its TTFT, TPOT and throughput side by side."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from rich.table import Table

from corelib.config.schema import WorkloadConfig
from corelib.engine.api import Engine
from corelib.engine.outputs import RequestOutput
from corelib.loadtest.workload import Request, arrival_offsets, build_workload
from corelib.support.stats import percentile


@dataclass
class ServePoint:
    """One engine serving the configured workload (arrivals, concurrency, dataset), as ``run`` does."""

    label: str
    handoff: str
    requests: int
    requests_failed: int
    request_rate: float
    max_concurrency: int
    wall_s: float
    tokens_per_s: float
    ttft_ms_p50: float | None
    ttft_ms_p99: float | None
    tpot_ms_p50: float | None
    tpot_ms_p99: float | None
    prefix_cache_hit_rate: float | None = None  # prompt tokens found in the prefix cache / looked up


def wants_serving(workload: WorkloadConfig) -> bool:
    """Whether the workload describes traffic (arrivals, a concurrency cap or a dataset) worth serving."""
    steady = 0 < workload.request_rate < math.inf
    return steady or workload.max_concurrency > 0 or bool(workload.dataset)


def serve(engine: Engine, workload: WorkloadConfig, label: str) -> ServePoint:
    """Serve ``workload`` to the end through ``engine``; latency percentiles and throughput."""
    from corelib.cli.run import drive

    model = engine.startup.config.model
    requests = build_workload(workload, model.vocab_size, model.eos_token_id, engine.tokenizer)
    outputs: list[RequestOutput] = []

    def keep(request: Request, output: RequestOutput) -> None:
        outputs.append(output)

    start = time.perf_counter()
    drive(engine, requests, arrival_offsets(workload, len(requests)), workload.max_concurrency, keep)
    wall = time.perf_counter() - start
    ttft = [o.ttft_ms for o in outputs if o.ttft_ms is not None]
    tpot = [o.tpot_ms for o in outputs if o.tpot_ms is not None]
    return ServePoint(
        label=label,
        handoff="on" if engine.async_handoff else "off",
        requests=len(outputs),
        requests_failed=sum(1 for o in outputs if o.finish_reason == "error"),
        request_rate=workload.request_rate,
        max_concurrency=workload.max_concurrency,
        wall_s=wall,
        tokens_per_s=sum(len(o.output_token_ids) for o in outputs) / wall if wall > 0 else 0.0,
        ttft_ms_p50=percentile(ttft, 50),
        ttft_ms_p99=percentile(ttft, 99),
        tpot_ms_p50=percentile(tpot, 50),
        tpot_ms_p99=percentile(tpot, 99),
        prefix_cache_hit_rate=engine.metrics(wall).get("prefix_cache_hit_rate"),
    )


def serve_table(points: list[ServePoint]) -> Table:
    table = Table(title="corelib bench: the workload served (arrivals as configured)")
    for column in ("engine", "requests (error)", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "tok/s", "wall s",
                   "prefix hits"):
        table.add_column(column, justify="right")

    def pair(low: float | None, high: float | None) -> str:
        return "-" if low is None else f"{low:.2f}/{high or 0:.2f}"

    for p in points:
        hits = "-" if p.prefix_cache_hit_rate is None else f"{p.prefix_cache_hit_rate * 100:.1f} %"
        table.add_row(p.label, f"{p.requests} ({p.requests_failed})", pair(p.ttft_ms_p50, p.ttft_ms_p99),
                      pair(p.tpot_ms_p50, p.tpot_ms_p99), f"{p.tokens_per_s:.0f}", f"{p.wall_s:.2f}", hits)
    return table
