"""``python -m corelib bench-serve``: load a running server and measure what clients see.

Like vLLM's benchmark_serving: the load is a request rate (Poisson arrivals) or a fixed number
of concurrent clients; prompts come from a JSONL file (``{"prompt": ...}`` per line: text, or
a list of token ids) or are random token ids. Every request streams with ``ignore_eos`` and
``max_tokens=output_len``, so each has a known length, and is checked: exactly one finished
choice, one ``[DONE]``, usage equal to what was asked. A share of clients hang up mid-stream
on purpose. Before and after the load the server's ``/metrics`` give its KV blocks and
resident memory, so a leak shows, and before and after each point its TPOT histogram gives
the engine's own TPOT beside the clients'.

Throughput counts completed requests over the span from the first send to the last answer;
TTFT is send to first text, TPOT the time after the first text per remaining token, ITL the time
between two text chunks (:mod:`corelib.loadtest.loadclient`). While a point runs, a progress
bar (or a line every few seconds on a pipe) counts its requests; at the end ``bench_serve.json``
holds every figure and ``bench_serve.png`` beside it plots each point's TTFT and ITL.

Two workload shapes the engine's scheduling is measured by: a shared prefix (every random prompt
starts with the same ``shared_prefix_len`` tokens, a system prompt, so prefix caching can reuse
its KV blocks; the point reports the server's prefix-cache hit rate), and mixed traffic
(``decoders`` requests keep decoding while the point's prompts arrive; their inter-token times
are reported apart, so a prompt that stalls the decoders shows as a long p99).

Long: one measurement from arguments to report: the load shapes (rate, concurrency, decoders),
the checks of every answer, and the server's own figures before and after.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import platform
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from corelib.config.schema import Endpoint, ServeBenchConfig
from corelib.errors import ConfigError, CorelibError
from corelib.loadtest.loadclient import ENGINE_RSS, PREFIX_HITS, PREFIX_QUERIED, TPOT_HISTOGRAM, Client, Outcome
from corelib.loadtest.plot import plot_latencies
from corelib.loadtest.workload import DATASET_LIMIT
from corelib.observe.rundir import RunDir
from corelib.sampling_params import SamplingError, SamplingParams
from corelib.support.progress import Progress, Task, current, reporting
from corelib.support.stats import percentile
from corelib.trust.files import parse_json, read_text

Prompt = str | list[int]
WORDS = ("the", "engine", "decodes", "a", "token", "every", "step", "while", "clients", "stream", "their", "answers")


@dataclass
class Point:
    """One load level and what it gave."""

    mode: str  # rate or concurrency
    load: float
    requests: int
    completed: int
    disconnected: int
    refused: int  # turned away up front (429 overloaded, 503 shutting down): said so, nothing lost
    failed: int
    incomplete: int
    duplicated: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_ms_p50: float | None
    ttft_ms_p99: float | None
    tpot_ms_p50: float | None
    tpot_ms_p99: float | None
    tpot_ms_mean: float | None = None
    # The engine's own TPOT of the requests that finished during the point (the server's
    # /metrics): what the clients saw beyond it is the server's doing.
    engine_tpot_ms_mean: float | None = None
    # Mixed traffic: the time between two tokens of the requests kept decoding meanwhile.
    decoder_itl_ms_p50: float | None = None
    decoder_itl_ms_p99: float | None = None
    decoder_tokens: int = 0
    # The server's prefix-cache hit rate over the point (prompt tokens found / looked up).
    prefix_cache_hit_rate: float | None = None
    errors: dict[str, int] = field(default_factory=dict)
    # The time between two text chunks of the point's completed requests (vLLM's ITL).
    itl_ms_p50: float | None = None
    itl_ms_p99: float | None = None
    # Every completed request's TTFT, and every gap between two of their chunks: what the plot draws.
    ttfts_ms: list[float] = field(default_factory=list)
    itls_ms: list[float] = field(default_factory=list)

    @property
    def lost(self) -> int:
        return self.failed + self.incomplete


class Load:
    """The requests of a run: prompts, payloads, who hangs up and when."""

    def __init__(self, spec: ServeBenchConfig, model: str) -> None:
        self.spec = spec
        self.model = model
        self.rng = random.Random(spec.seed)
        self.prompts = _read_dataset(Path(spec.dataset)) if spec.dataset else None
        self._cycle: Iterator[Prompt] | None = itertools.cycle(self.prompts) if self.prompts else None
        # the cuts a request sets, where they cut (top_k and min_p are vLLM's fields beside OpenAI's)
        self.cuts = {name: value for name, value, neutral in (("top_p", spec.top_p, 1.0), ("top_k", spec.top_k, 0),
                                                              ("min_p", spec.min_p, 0.0)) if value != neutral}
        prefix = random.Random(spec.seed + 1)  # the same system prompt whatever the load's own draws
        if spec.endpoint is Endpoint.chat:
            self.prefix: Prompt = " ".join(prefix.choice(WORDS) for _ in range(spec.shared_prefix_len))
        else:
            self.prefix = [prefix.randrange(2, 256) for _ in range(spec.shared_prefix_len)]

    def next_request(self) -> tuple[dict[str, object], int | None]:
        """A payload and, for a client that will hang up, after how many text chunks."""
        spec = self.spec
        prompt = next(self._cycle) if self._cycle is not None else self._random_prompt()
        hang_up = None
        if self.rng.random() < spec.disconnect_fraction:
            hang_up = self.rng.randint(1, max(1, spec.output_len - 1))
        payload: dict[str, object] = {
            "model": self.model, "max_tokens": spec.output_len, "temperature": spec.temperature, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **self.cuts,
        }
        if spec.endpoint is Endpoint.chat:
            text = prompt if isinstance(prompt, str) else " ".join(str(t) for t in prompt)
            payload["messages"] = [{"role": "user", "content": text}]
        else:
            payload["prompt"] = prompt
        return payload, hang_up

    def _random_prompt(self, length: int | None = None, shared: bool = True) -> Prompt:
        count = self.spec.prompt_len if length is None else length
        if self.spec.endpoint is Endpoint.chat:
            text = " ".join(self.rng.choice(WORDS) for _ in range(count))
            prefix = self.prefix if shared and isinstance(self.prefix, str) else ""
            return f"{prefix} {text}" if prefix else text
        ids = [self.rng.randrange(2, 256) for _ in range(count)]  # inside any real vocabulary
        return [*self.prefix, *ids] if shared and isinstance(self.prefix, list) else ids

    def decoder_request(self) -> dict[str, object]:
        """A request kept decoding while a point's load arrives (mixed traffic)."""
        spec = self.spec
        payload, _ = self.next_request()
        prompt = self._random_prompt(spec.decoder_prompt_len, shared=False)
        if spec.endpoint is Endpoint.chat:
            payload["messages"] = [{"role": "user", "content": prompt}]
        else:
            payload["prompt"] = prompt
        payload["max_tokens"] = spec.decoder_output_len
        return payload


def _read_dataset(path: Path) -> list[Prompt]:
    lines = read_text(path, "server.bench.dataset", DATASET_LIMIT).splitlines()  # a regular file, bounded
    prompts: list[Prompt] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            prompt = parse_json(line, f"{path}:{number}")["prompt"]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f'{path}:{number}: expected a JSON object with "prompt" per line') from None
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))):
            raise ConfigError(f"{path}:{number}: a prompt is text or a list of token ids")
        prompts.append(prompt)
    if not prompts:
        raise ConfigError(f"server.bench.dataset={path}: holds no prompts")
    return prompts


async def _run_point(client: Client, load: Load, mode: str, level: float, task: Task | None = None) -> Point:
    """One load level; ``task`` (the progress shown) advances as each request ends."""
    spec = load.spec
    limit = spec.num_requests or math.inf
    end = time.perf_counter() + spec.duration_s if spec.duration_s > 0 else math.inf
    outcomes: list[Outcome] = []
    start = time.perf_counter()

    async def one() -> None:
        payload, hang_up = load.next_request()
        outcomes.append(await client.request(payload, hang_up))
        if task is not None:
            task.advance()

    engine_before = await _engine_tpot(client)
    cache_before = await _prefix_cache(client)
    stop = asyncio.Event()
    started = [asyncio.Event() for _ in range(spec.decoders)]
    gaps: list[float] = []
    decoders = [asyncio.create_task(_decode_until(client, load, stop, ready, gaps)) for ready in started]
    if decoders:  # the load arrives once every decoder streams
        await asyncio.wait_for(asyncio.gather(*(ready.wait() for ready in started)), spec.timeout_s)
        start = time.perf_counter()
        gaps.clear()
    sent = 0
    if mode == "rate":
        tasks: list[asyncio.Task[None]] = []
        next_at = start
        while sent < limit and next_at < end:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            tasks.append(asyncio.create_task(one()))
            sent += 1
            next_at += load.rng.expovariate(level)
        await asyncio.gather(*tasks)
    else:
        counter = itertools.count()

        async def worker() -> None:
            while next(counter) < limit and time.perf_counter() < end:
                await one()

        await asyncio.gather(*(worker() for _ in range(int(level))))
    point = _summarize(mode, level, outcomes, time.perf_counter() - start)
    stop.set()
    await asyncio.gather(*decoders)
    point.decoder_tokens = len(gaps)
    point.decoder_itl_ms_p50 = percentile([g * 1e3 for g in gaps], 50)
    point.decoder_itl_ms_p99 = percentile([g * 1e3 for g in gaps], 99)
    cache_after = await _prefix_cache(client)
    if cache_before is not None and cache_after is not None and cache_after[0] > cache_before[0]:
        point.prefix_cache_hit_rate = (cache_after[1] - cache_before[1]) / (cache_after[0] - cache_before[0])
    engine_after = await _engine_tpot(client)
    if engine_before is not None and engine_after is not None and engine_after[1] > engine_before[1]:
        point.engine_tpot_ms_mean = (engine_after[0] - engine_before[0]) * 1e3 / (engine_after[1] - engine_before[1])
    return point


async def _decode_until(client: Client, load: Load, stop: asyncio.Event, ready: asyncio.Event,
                        gaps: list[float]) -> None:
    """Keep one request decoding until ``stop``: ask again when one ends; every gap between two of its
    text pieces goes to ``gaps``."""
    while not stop.is_set():
        last: float | None = None
        async with client.sse.post(client.path, load.decoder_request()) as response:
            if response.status != 200:
                raise CorelibError(f"a decoder's request was answered {response.status}: "
                                   f"{(await response.read()).decode(errors='replace')[:200]}")
            async for data in response.events():
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if any(c.get("text") or (c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    ready.set()
                if stop.is_set():
                    return  # leaving the block hangs up


async def _prefix_cache(client: Client) -> tuple[float, float] | None:
    """(prompt tokens looked up, found) in the server's prefix cache so far; None if /metrics cannot be read."""
    try:
        figures = await client.metrics()
    except httpx.HTTPError:
        return None
    return figures.get(PREFIX_QUERIED, 0.0), figures.get(PREFIX_HITS, 0.0)


async def _engine_tpot(client: Client) -> tuple[float, float] | None:
    """(seconds, requests) summed by the server's TPOT histogram so far; None if /metrics cannot be read."""
    try:
        figures = await client.metrics()
    except httpx.HTTPError:
        return None
    return figures.get(f"{TPOT_HISTOGRAM}_sum", 0.0), figures.get(f"{TPOT_HISTOGRAM}_count", 0.0)


def _summarize(mode: str, level: float, outcomes: list[Outcome], duration: float) -> Point:
    by_status = {s: [o for o in outcomes if o.status == s] for s in ("completed", "disconnected", "refused",
                                                                   "failed", "incomplete")}
    completed = by_status["completed"]
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.error:
            errors[o.error] = errors.get(o.error, 0) + 1
    ttft = [o.ttft_s * 1e3 for o in completed if o.ttft_s is not None]
    tpot = [o.tpot_s * 1e3 for o in completed if o.tpot_s is not None]
    itl = [gap * 1e3 for o in completed for gap in o.gaps_s]
    return Point(
        mode=mode, load=level, requests=len(outcomes), completed=len(completed),
        disconnected=len(by_status["disconnected"]), refused=len(by_status["refused"]),
        failed=len(by_status["failed"]),
        incomplete=len(by_status["incomplete"]), duplicated=sum(1 for o in outcomes if o.duplicated),
        duration_s=duration, requests_per_s=len(completed) / duration if duration > 0 else 0.0,
        output_tokens_per_s=sum(o.completion_tokens for o in completed) / duration if duration > 0 else 0.0,
        ttft_ms_p50=percentile(ttft, 50), ttft_ms_p99=percentile(ttft, 99),
        tpot_ms_p50=percentile(tpot, 50), tpot_ms_p99=percentile(tpot, 99),
        tpot_ms_mean=sum(tpot) / len(tpot) if tpot else None, errors=errors,
        itl_ms_p50=percentile(itl, 50), itl_ms_p99=percentile(itl, 99), ttfts_ms=ttft, itls_ms=itl,
    )


async def _settle(client: Client, within_s: float) -> tuple[dict[str, float], float]:
    """The server's gauges once nothing runs and every KV block is free (or ``within_s`` passed)."""
    start = time.perf_counter()
    while True:
        figures = await client.metrics()
        idle = (figures.get("corelib_requests_running", 0) + figures.get("corelib_requests_waiting", 0) == 0
                and figures.get("corelib_kv_blocks_free") == figures.get("corelib_kv_blocks_total"))
        waited = time.perf_counter() - start
        if idle or waited >= within_s:
            return figures, waited
        await asyncio.sleep(0.2)


async def _sample(client: Client, every_s: float, samples: list[dict[str, float]]) -> None:
    """The server's gauges every ``every_s`` seconds while the load runs: memory over time shows a leak."""
    start = time.perf_counter()
    while True:
        with contextlib.suppress(httpx.HTTPError):
            samples.append({"t_s": time.perf_counter() - start, **await client.metrics()})
        await asyncio.sleep(every_s)


async def run_bench(spec: ServeBenchConfig, console: Console) -> dict[str, object]:
    if spec.num_requests <= 0 and spec.duration_s <= 0:
        raise ConfigError("server.bench: set num_requests or duration_s (both are 0, so the load would never end)")
    if not 0 <= spec.disconnect_fraction <= 1:
        raise ConfigError(f"server.bench.disconnect_fraction={spec.disconnect_fraction}: must be in [0, 1]")
    try:  # the server's own checks of each value, before any request is sent
        SamplingParams(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k, min_p=spec.min_p)
    except SamplingError as error:
        raise ConfigError(f"server.bench.{error}") from None
    levels = [("rate", float(r)) for r in spec.rates] + [("concurrency", float(c)) for c in spec.concurrency]
    if not levels or any(level <= 0 for _, level in levels):
        raise ConfigError("server.bench: give positive rates (requests/s) or concurrency values")
    client = Client(spec)
    try:
        try:
            model = spec.model or await client.model()
            before, _ = await _settle(client, spec.settle_s)
        except httpx.HTTPError as error:
            raise CorelibError(f"cannot reach the server at {spec.url}: {error}; start it with "
                               "python -m corelib serve, or set server.bench.url") from None
        load = Load(spec, model)
        points = []
        samples: list[dict[str, float]] = []
        sampler = asyncio.create_task(_sample(client, spec.sample_s, samples)) if spec.sample_s > 0 else None
        try:
            for mode, level in levels:
                unit = "requests/s" if mode == "rate" else "clients"
                with current().task(f"bench-serve: {level:g} {unit}", total=spec.num_requests or None,
                                    unit="requests") as task:
                    points.append(await _run_point(client, load, mode, level, task))
        finally:
            if sampler is not None:
                sampler.cancel()
        after, waited = await _settle(client, spec.settle_s)
    finally:
        await client.aclose()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": {"python": platform.python_version(), "cpu_count": os.cpu_count()},
        "url": spec.url, "endpoint": spec.endpoint.value, "model": model,
        "settings": {k: v for k, v in asdict(spec).items() if k != "api_key"},
        "points": [{**asdict(p), "lost": p.lost} for p in points],
        "server_before": before, "server_after": after, "settle_s": waited, "server_samples": samples,
    }


def table(result: dict[str, object]) -> Table:
    out = Table(title=f"bench-serve {result['url']} ({result['endpoint']}, {result['model']})")
    points = result["points"]
    assert isinstance(points, list)
    mixed = any(p["decoder_tokens"] for p in points)
    cached = any(p["prefix_cache_hit_rate"] is not None for p in points)
    for column in ("load", "requests", "ok", "hung up", "refused", "lost", "dup", "req/s", "out tok/s",
                   "TTFT ms p50/p99", "TPOT ms p50/p99", "ITL ms p50/p99", "TPOT mean: clients/engine ms",
                   *(["decoders' inter-token ms p50/p99"] if mixed else []), *(["prefix hits"] if cached else [])):
        out.add_column(column, justify="right")
    for p in points:
        extra = [f"{_ms(p['decoder_itl_ms_p50'], 2)}/{_ms(p['decoder_itl_ms_p99'], 2)}"] if mixed else []
        if cached:
            rate = p["prefix_cache_hit_rate"]
            extra.append("-" if rate is None else f"{rate * 100:.1f} %")
        unit = "req/s" if p["mode"] == "rate" else "clients"
        out.add_row(
            f"{p['load']:g} {unit}", str(p["requests"]), str(p["completed"]), str(p["disconnected"]),
            str(p["refused"]), str(p["lost"]), str(p["duplicated"]), f"{p['requests_per_s']:.2f}",
            f"{p['output_tokens_per_s']:.1f}",
            f"{_ms(p['ttft_ms_p50'])}/{_ms(p['ttft_ms_p99'])}", f"{_ms(p['tpot_ms_p50'])}/{_ms(p['tpot_ms_p99'])}",
            f"{_ms(p['itl_ms_p50'])}/{_ms(p['itl_ms_p99'])}",
            f"{_ms(p['tpot_ms_mean'], 3)}/{_ms(p['engine_tpot_ms_mean'], 3)}", *extra,
        )
    return out


def _ms(value: object, digits: int = 1) -> str:
    return "-" if not isinstance(value, float) else f"{value:.{digits}f}"


def bench_serve(spec: ServeBenchConfig, run_dir: RunDir, console: Console) -> dict[str, object]:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Hydra logs INFO: one line per request otherwise
    with reporting(Progress(console)):  # each point's requests done so far, as they end
        result = asyncio.run(run_bench(spec, console))
    console.print(table(result))
    before, after = result["server_before"], result["server_after"]
    assert isinstance(before, dict) and isinstance(after, dict)
    rss = [f.get("process_resident_memory_bytes", 0.0) / 2**20 for f in (before, after)]
    free = [f.get("corelib_kv_blocks_free", math.nan) for f in (before, after)]
    engine = [f.get(ENGINE_RSS, math.nan) / 2**20 for f in (before, after)]
    console.print(f"corelib: server before / after the load: KV blocks free {free[0]:.0f} / {free[1]:.0f} of "
                  f"{after.get('corelib_kv_blocks_total', math.nan):.0f}; resident memory {rss[0]:.1f} / "
                  f"{rss[1]:.1f} MiB" + ("" if math.isnan(engine[0]) else
                                         f", its engine process {engine[0]:.1f} / {engine[1]:.1f} MiB"),
                  soft_wrap=True)
    samples = result["server_samples"]
    assert isinstance(samples, list)
    if len(samples) >= 2:
        first, last = (s.get("process_resident_memory_bytes", math.nan) / 2**20 for s in (samples[0], samples[-1]))
        console.print(f"corelib: server resident memory during the load: {first:.1f} MiB at "
                      f"{samples[0]['t_s']:.0f} s, {last:.1f} MiB at {samples[-1]['t_s']:.0f} s")
    path = run_dir.write_file("bench_serve.json", json.dumps(result, indent=2) + "\n")
    console.print(f"corelib: wrote {path}")
    try:
        picture = plot_latencies(result, path.with_suffix(".png"))
    except ConfigError as error:  # matplotlib is an extra: the figures stand without their picture
        console.print(f"corelib: no plot: {error}", soft_wrap=True)
    else:
        console.print(f"corelib: wrote {picture} (TTFT and inter-token latency of each point)")
    return result
