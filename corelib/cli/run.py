"""`python -m corelib run`: the workload through the engine, progress, a table, the files.

Requests join the engine at their arrival times (``workload.request_rate``) and while fewer
than ``workload.max_concurrency`` are in flight, between engine steps. Each finished request
is written to ``outputs.jsonl`` at once, so Ctrl-C keeps what finished.

Text prompts (``workload.prompts``) stream their output instead of the progress bar: one
prompt prints its text as it is generated; several print each answer when it is complete.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from corelib.engine.api import Engine
from corelib.engine.outputs import RequestOutput
from corelib.engine.streaming import DeltaTracker, TokenDelta
from corelib.loadtest.workload import Request, arrival_offsets, build_workload
from corelib.observe.rundir import OutputsWriter, RunDir
from corelib.startup.start import Startup
from corelib.support.progress import console_log, say, show
from corelib.support.progress import current as current_progress
from corelib.support.text import Tokenizer
from corelib.trust.files import RunDirError

IDLE_WAIT_S = 0.05  # longest sleep while nothing runs and the next request has not arrived


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
    reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(metrics["finish_reasons"].items()))
    rows = [
        ("requests (ended in error)", f"{metrics['requests']} ({metrics['requests_failed']})"),
        ("finish reasons", reasons or "-"),
        ("arrivals", _arrivals(metrics)),
        ("prompt / output tokens", f"{metrics['prompt_tokens']} / {metrics['output_tokens']}"),
        ("TTFT p50 / p99", f"{_fmt(metrics['ttft_ms_p50'], ' ms')} / {_fmt(metrics['ttft_ms_p99'], ' ms')}"),
        ("TPOT p50 / p99", f"{_fmt(metrics['tpot_ms_p50'], ' ms')} / {_fmt(metrics['tpot_ms_p99'], ' ms')}"),
        ("tokens/s", _fmt(metrics["tokens_per_s"], digits=1)),
        ("device occupancy (steady decode)", _fmt(metrics["occupancy"], " %", 100.0, 1)),
        ("median idle gap between decode steps", _fmt(metrics["idle_gap_median_us"], " µs", digits=1)),
        ("steps: prefill / decode", f"{metrics['steps_prefill']} / {metrics['steps_decode']}"),
        ("steps: sync / async path", f"{metrics['steps_sync']} / {metrics['steps_async']}"),
        ("steps: graph / eager", f"{metrics['graph_steps']} / {metrics['eager_steps']}"),
        ("startup", _startup(metrics)),
        ("preemptions", str(metrics["preemptions"])),
        ("prefix cache: hit / looked-up prompt tokens", _prefix_cache(metrics)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    for reason, count in metrics["sync_step_reasons"].items():
        table.add_row(f"  synchronous steps: {reason}", str(count))
    return table


def _startup(metrics: dict[str, Any]) -> str:
    startup = metrics.get("startup_s")
    if startup is None:
        return "-"
    if "graph_capture_s" not in metrics:
        return f"{startup:.1f} s"
    graphs = metrics["graphs_decode"] + metrics["graphs_prompt"] + metrics["graphs_sampling"]
    return (f"{startup:.1f} s ({graphs} graphs captured in {metrics['graph_capture_s']:.1f} s, "
            f"{metrics['graph_memory_bytes'] / 2**20:.0f} MiB)")


def _prefix_cache(metrics: dict[str, Any]) -> str:
    rate = metrics.get("prefix_cache_hit_rate")
    if rate is None:
        return "-"
    return (f"{metrics['prefix_cache_hit_tokens']} / {metrics['prefix_cache_queried_tokens']} "
            f"({rate * 100:.1f} %, {metrics['prefix_cache_evicted_blocks']} blocks evicted)")


def _arrivals(metrics: dict[str, Any]) -> str:
    rate, cap = metrics.get("request_rate") or 0.0, metrics.get("max_concurrency") or 0
    when = "all at once" if rate in (0.0, float("inf")) else f"Poisson, {rate:g} requests/s"
    return when + (f", at most {cap} in flight" if cap else "")


def drive(
    engine: Engine,
    requests: list[Request],
    offsets: list[float],
    max_concurrency: int,
    on_finish: Callable[[Request, RequestOutput], None],
    on_delta: Callable[[Request, TokenDelta], None] | None = None,
) -> None:
    """Add each request at its offset (seconds from now) while fewer than ``max_concurrency``
    (0: any number) are in flight, and step the engine until every one has finished.

    ``on_finish`` sees each output as its request finishes; ``on_delta``, when given, every
    request's new tokens and text after each step (the engine then streams).
    """
    waiting = deque(zip(offsets, requests, strict=True))
    added: dict[str, Request] = {}
    tracker = DeltaTracker(engine.tokenizer) if on_delta is not None else None
    in_flight = 0
    start = time.perf_counter()
    while waiting or in_flight:
        now = time.perf_counter() - start
        while waiting and waiting[0][0] <= now and (not max_concurrency or in_flight < max_concurrency):
            _, request = waiting.popleft()
            request_id = engine.add_request(request.prompt_token_ids, request.sampling, multimodal=request.multimodal)
            added[request_id] = request
            in_flight += 1
        if tracker is not None and on_delta is not None:
            deltas = engine.step_tokens(tracker)
            for delta in deltas:
                on_delta(added[delta.request_id], delta)
            finished = [d.output for d in deltas if d.output is not None]
        elif engine.has_unfinished:
            finished = engine.step()
        else:
            finished = engine.take_finished()  # requests refused at add_request
        for output in finished:
            in_flight -= 1
            on_finish(added.pop(output.request_id), output)
        if not finished and not engine.has_unfinished and waiting:
            time.sleep(min(IDLE_WAIT_S, max(0.0, waiting[0][0] - (time.perf_counter() - start))))


class _TextShow:
    """Prints the text of ``workload.prompts``: live for one prompt, each whole answer for several."""

    def __init__(self, console: Console, count: int, status: Console) -> None:
        self.console = console
        self.status = status
        self.live = count == 1
        self.started: set[str] = set()

    def _write(self, text: str, style: str | None = None) -> None:
        self.console.print(text, style=style, end="", markup=False, highlight=False, soft_wrap=True)

    def delta(self, request: Request, delta: TokenDelta) -> None:
        if not self.live:
            return
        if delta.request_id not in self.started:
            self.started.add(delta.request_id)
            self._write(request.prompt or "", "dim")
        self._write(delta.text)

    def finished(self, request: Request, output: RequestOutput) -> None:
        console_log.info("request %s: %s%s", output.request_id, request.prompt or "", output.text or "")
        if self.live:
            self._write("\n")  # the prompt and the text came with the deltas
        else:
            self.console.rule(f"request {output.request_id}", style="dim")
            self._write(request.prompt or "", "dim")
            self._write((output.text or "") + "\n")
        if output.error:
            say(self.status, f"request {output.request_id} failed: {output.error}")


def run(startup: Startup, run_dir: RunDir, console: Console, output: Console | None = None) -> dict[str, Any]:
    """Run the configured workload; returns the metrics it wrote.

    Status lines go to ``console``; the generated text of ``workload.prompts`` to ``output``.
    """
    cfg = startup.config
    tokenizer = Tokenizer.from_directory(cfg.model.path)
    requests = build_workload(cfg.workload, cfg.model.vocab_size, cfg.model.eos_token_id, tokenizer)
    offsets = arrival_offsets(cfg.workload, len(requests))
    failed: list[RequestOutput] = []
    write_error: RunDirError | None = None
    with Engine(startup) as engine, run_dir.outputs() as outputs:
        for notice in engine.notices:
            say(console, notice)

        def keep(output: RequestOutput) -> None:
            if output.error:
                failed.append(output)
            outputs.write(output.record())

        start = time.perf_counter()
        try:
            if cfg.workload.prompts:
                text = _TextShow(output or console, len(requests), console)

                def finished(request: Request, output: RequestOutput) -> None:
                    text.finished(request, output)
                    keep(output)

                drive(engine, requests, offsets, cfg.workload.max_concurrency, finished, text.delta)
            else:
                with current_progress().task("decoding", total=len(requests), unit="requests") as task:

                    def counted(request: Request, output: RequestOutput) -> None:
                        keep(output)
                        task.advance()

                    drive(engine, requests, offsets, cfg.workload.max_concurrency, counted)
        except RunDirError as error:
            write_error = error  # the engine closes; the figures of what finished are still written
        wall = time.perf_counter() - start
        metrics = _metrics(engine, startup, wall)
        trace = engine.write_trace(run_dir.file("trace.json")) if cfg.engine.trace else None
    _finish(run_dir, outputs, metrics, failed, write_error, console)
    if trace is not None:
        say(console, f"wrote {trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    return metrics


def _metrics(engine: Engine, startup: Startup, wall: float) -> dict[str, Any]:
    cfg = startup.config
    metrics = dict(engine.metrics(wall))
    metrics.update(
        preemptions=engine.stats().num_preemptions,
        backend=startup.spec.backend,
        runtime=startup.spec.runtime.value,
        async_token_handoff=engine.async_handoff,
        transport=cfg.engine.transport.value,
        shm_materialization=engine.materialization,
        request_rate=cfg.workload.request_rate,
        max_concurrency=cfg.workload.max_concurrency,
        startup_s=engine.startup_s,
    )
    if engine.graphs is not None:
        metrics.update(graphs_decode=engine.graphs.decode, graphs_prompt=engine.graphs.prompt,
                       graphs_sampling=engine.graphs.sampling, graph_capture_s=engine.graphs.capture_s,
                       graph_memory_bytes=engine.graphs.memory_bytes)
    return metrics


def _finish(
    run_dir: RunDir,
    outputs: OutputsWriter,
    metrics: dict[str, Any],
    failed: list[RequestOutput],
    write_error: RunDirError | None,
    console: Console,
) -> None:
    """Write metrics.json, show the summary and say what went wrong; a failed write is raised last."""
    try:
        run_dir.write_metrics(metrics)
    except RunDirError as error:
        write_error = RunDirError(f"{write_error}; metrics.json was not written either") if write_error else error
    show(console, summary_table(metrics))
    if failed:
        first = failed[0]
        say(console, f"{len(failed)} of {metrics['requests']} requests ended in error (finish_reason error in "
                     f"{outputs.path}); the first, request {first.request_id}: {first.error}")
    if write_error is not None:
        raise write_error
    say(console, f"wrote {run_dir.path}/{{config.yaml,plan.json,metrics.json,outputs.jsonl}}")
