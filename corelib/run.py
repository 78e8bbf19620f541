"""`python -m corelib run`: the workload through the engine, a progress bar, a table, the files."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from corelib.engine.api import Engine, RequestOutput
from corelib.rundir import RunDir
from corelib.startup import Startup
from corelib.workload import build_workload


def _fmt(value: Any, unit: str = "", scale: float = 1.0, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value * scale:.{digits}f}{unit}"
    return f"{value}{unit}"


def summary_table(metrics: dict[str, Any]) -> Table:
    table = Table(title="run summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("requests (failed)", f"{metrics['requests']} ({metrics['requests_failed']})"),
        ("prompt / output tokens", f"{metrics['prompt_tokens']} / {metrics['output_tokens']}"),
        ("TTFT p50 / p99", f"{_fmt(metrics['ttft_ms_p50'], ' ms')} / {_fmt(metrics['ttft_ms_p99'], ' ms')}"),
        ("TPOT p50 / p99", f"{_fmt(metrics['tpot_ms_p50'], ' ms')} / {_fmt(metrics['tpot_ms_p99'], ' ms')}"),
        ("tokens/s", _fmt(metrics["tokens_per_s"], digits=1)),
        ("device occupancy (steady decode)", _fmt(metrics["occupancy"], " %", 100.0, 1)),
        ("median idle gap between decode steps", _fmt(metrics["idle_gap_median_us"], " µs", digits=1)),
        ("steps: prefill / decode", f"{metrics['steps_prefill']} / {metrics['steps_decode']}"),
        ("steps: sync / async path", f"{metrics['steps_sync']} / {metrics['steps_async']}"),
        ("decode steps: graph / eager", f"{metrics['graph_steps']} / {metrics['eager_steps']}"),
        ("preemptions", str(metrics["preemptions"])),
    ]
    for name, value in rows:
        table.add_row(name, value)
    for reason, count in metrics["sync_step_reasons"].items():
        table.add_row(f"  synchronous steps: {reason}", str(count))
    return table


def run(startup: Startup, run_dir: RunDir, console: Console) -> dict[str, Any]:
    """Run the configured workload; returns the metrics it wrote."""
    run_dir.write_config(startup.raw)
    run_dir.write_plan(startup.plan, startup.messages)
    cfg = startup.config
    requests = build_workload(cfg.workload, cfg.model.vocab_size, cfg.model.eos_token_id)
    with Engine(startup) as engine:
        outputs: dict[str, RequestOutput] = {}
        columns = (TextColumn("decoding"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("requests", total=len(requests))
            ids = [
                engine.add_request(r.prompt_token_ids, r.sampling, multimodal=r.multimodal) for r in requests
            ]
            start = time.perf_counter()
            for output in engine.stream():
                outputs[output.request_id] = output
                progress.advance(task)
            wall = time.perf_counter() - start
        metrics = dict(engine.metrics(wall))
        metrics.update(
            graph_steps=engine.runner.num_graph_steps,
            eager_steps=engine.runner.num_eager_steps,
            preemptions=engine.scheduler.num_preemptions,
            backend=startup.spec.backend,
            runtime=startup.spec.runtime.value,
            async_token_handoff=engine.async_handoff,
        )
    run_dir.write_outputs(outputs[i].record() for i in ids)
    run_dir.write_metrics(metrics)
    console.print(summary_table(metrics))
    console.print(f"corelib: wrote {run_dir.path}/{{config.yaml,plan.json,metrics.json,outputs.jsonl}}")
    return metrics
