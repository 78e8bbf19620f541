"""`python -m corelib run`: the workload through the engine, a progress bar, a table, the files.

Text prompts (``workload.prompts``) stream their output instead of the progress bar: one
prompt prints its text as it is generated; several print each answer when it is complete.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from corelib.engine.api import Engine, RequestOutput
from corelib.rundir import RunDir
from corelib.startup import Startup
from corelib.text import Tokenizer
from corelib.workload import Request, build_workload


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


def _with_progress(engine: Engine, total: int, console: Console) -> dict[str, RequestOutput]:
    outputs: dict[str, RequestOutput] = {}
    columns = (TextColumn("decoding"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("requests", total=total)
        for output in engine.stream():
            outputs[output.request_id] = output
            progress.advance(task)
    return outputs


def _stream_text(engine: Engine, requests: dict[str, Request], console: Console) -> dict[str, RequestOutput]:
    outputs: dict[str, RequestOutput] = {}
    live = len(requests) == 1

    def write(text: str, style: str | None = None) -> None:
        console.print(text, style=style, end="", markup=False, highlight=False, soft_wrap=True)

    if live:
        write(next(iter(requests.values())).prompt or "", "dim")
    for delta in engine.stream_tokens():
        if live:
            write(delta.text)
        if delta.output is None:
            continue
        output = outputs[delta.request_id] = delta.output
        if live:
            write("\n")
        else:
            console.rule(f"request {delta.request_id}", style="dim")
            write(requests[delta.request_id].prompt or "", "dim")
            write((output.text or "") + "\n")
        if output.error:
            console.print(f"corelib: request {delta.request_id} failed: {output.error}", markup=False)
    return outputs


def run(startup: Startup, run_dir: RunDir, console: Console) -> dict[str, Any]:
    """Run the configured workload; returns the metrics it wrote."""
    cfg = startup.config
    tokenizer = Tokenizer.from_directory(cfg.model.path)
    requests = build_workload(cfg.workload, cfg.model.vocab_size, cfg.model.eos_token_id, tokenizer)
    with Engine(startup) as engine:
        for notice in engine.notices:
            console.print(f"corelib: {notice}", markup=False)
        ids = [engine.add_request(r.prompt_token_ids, r.sampling, multimodal=r.multimodal) for r in requests]
        start = time.perf_counter()
        if any(r.prompt is not None for r in requests):
            outputs = _stream_text(engine, dict(zip(ids, requests, strict=True)), console)
        else:
            outputs = _with_progress(engine, len(requests), console)
        wall = time.perf_counter() - start
        metrics = dict(engine.metrics(wall))
        trace = engine.write_trace(run_dir.file("trace.json")) if cfg.engine.trace else None
        metrics.update(
            preemptions=engine.scheduler.num_preemptions,
            backend=startup.spec.backend,
            runtime=startup.spec.runtime.value,
            async_token_handoff=engine.async_handoff,
            transport=cfg.engine.transport.value,
            shm_materialization=engine.materialization,
        )
    run_dir.write_outputs(outputs[i].record() for i in ids)
    run_dir.write_metrics(metrics)
    console.print(summary_table(metrics))
    console.print(f"corelib: wrote {run_dir.path}/{{config.yaml,plan.json,metrics.json,outputs.jsonl}}")
    if trace is not None:
        console.print(f"corelib: wrote {trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    return metrics
