"""``python -m corelib.loadtest.streambench``: what streaming costs the server, measured without a model.

A server over :class:`~corelib.server.fake.FakeEngine` (one token per running request every
``--step-ms``, nothing computed) runs in a process of its own; this process drives
``--clients`` streaming clients against it, each asking for ``--tokens`` tokens again and
again as soon as its last answer ended. Over ``--seconds`` after a warm-up it reports what the
clients received (tokens/s, SSE events/s, tokens per event), their TPOT against the engine's
step, and the server's CPU time per streamed token, by process. Several ``--step-ms`` values
give one row each; the highest token rate the server sustains is where TPOT leaves the step.

The clients speak HTTP/1.1 on raw sockets and only count bytes, so that they cost far less
than the server they measure. CPU times come from ``/proc`` (Linux).

    python -m corelib.loadtest.streambench --step-ms 4,2,1 --clients 64
    python -m corelib.loadtest.streambench --url http://127.0.0.1:8000 --pid 1234   # a server already running
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from corelib.support.stats import percentile

TOKEN_MARK = b"<"  # a model without a tokenizer streams each token as <id>; nothing else in a chunk has it
END_OF_BODY = b"\r\n0\r\n\r\n"  # the last chunk of a chunked response
STARTUP_TIMEOUT_S = 120.0


@dataclass
class Window:
    """What the clients saw while the window was open."""

    tokens: int = 0
    events: int = 0
    completed: int = 0
    wrong: int = 0  # answers that were not a 200 with exactly the tokens asked for and one [DONE]
    tpot_ms: list[float] = field(default_factory=list)
    open: bool = False


class _Stream(asyncio.Protocol):
    """One client on one keep-alive connection: a request, its whole answer, the next request."""

    def __init__(self, request: bytes, tokens: int, window: Window, running: asyncio.Event) -> None:
        self._request = request
        self._want = tokens
        self._window = window
        self._running = running
        self._transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._reset()

    def _reset(self) -> None:
        self._tail = b""
        self._head = True
        self._ok = False
        self._tokens = 0
        self._done_markers = 0
        self._first: float | None = None
        self._last = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport), "a TCP connection gives a Transport"
        self._transport = transport
        transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        window = self._window
        if self._head:
            self._ok = data.startswith(b"HTTP/1.1 200")
            self._head = False
        tokens = data.count(TOKEN_MARK)
        if tokens:
            self._tokens += tokens
            self._first = self._first or now
            self._last = now
        self._done_markers += data.count(b"[DONE]")
        if window.open:
            window.tokens += tokens
            window.events += data.count(b"data: ")
        self._tail = (self._tail + data)[-len(END_OF_BODY):]
        if self._tail == END_OF_BODY:
            self._answered()

    def _answered(self) -> None:
        window = self._window
        good = self._ok and self._tokens == self._want and self._done_markers == 1
        if window.open:
            window.completed += 1
            window.wrong += not good
            if good and self._first is not None and self._tokens > 1:
                window.tpot_ms.append((self._last - self._first) * 1e3 / (self._tokens - 1))
        self._reset()
        if self._running.is_set() and self._transport is not None:
            self._transport.write(self._request)
        elif self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def engine_tpot(url: str) -> tuple[float, float]:
    """(sum of seconds, count) of the engine's own TPOT over the requests that finished so far, from /metrics."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=30)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    figures = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("corelib_time_per_output_token_seconds_sum", "corelib_time_per_output_token_seconds_count"):
            figures[name.rsplit("_", 1)[1]] = float(value)
    return figures.get("sum", 0.0), figures.get("count", 0.0)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Result:
    step_ms: float | None
    clients: int
    tokens_per_request: int
    seconds: float
    tokens_per_s: float
    events_per_s: float
    tokens_per_event: float
    completed: int
    wrong: int
    tpot_ms_p50: float | None
    tpot_ms_p90: float | None
    engine_tpot_ms: float | None  # the engine's own, over the requests that finished in the window
    tpot_over_engine: float | None  # the clients' mean over the engine's mean
    server_cpu_s: dict[str, float]  # by process name
    server_cpu_us_per_token: float | None
    http_cpu_us_per_event: float | None  # the HTTP process alone (the first of the pids)
    client_cpu_us_per_token: float | None


async def load(url: str, pids: dict[str, int], clients: int, tokens: int, warmup_s: float, seconds: float,
               step_ms: float | None) -> Result:
    """Stream from ``url`` with ``clients`` clients; measure the window after ``warmup_s``."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    body = json.dumps({"prompt": [5, 6, 7, 8], "max_tokens": tokens, "ignore_eos": True, "stream": True,
                       "temperature": 0.0}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    window = Window()
    running = asyncio.Event()
    running.set()
    loop = asyncio.get_running_loop()
    streams = []
    for _ in range(clients):
        _, stream = await loop.create_connection(lambda: _Stream(request, tokens, window, running), host, port)
        streams.append(stream)
    await asyncio.sleep(warmup_s)
    tpot_before = await asyncio.to_thread(engine_tpot, url)
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    client_before = time.process_time()
    window.open = True
    opened = time.perf_counter()
    await asyncio.sleep(seconds)
    window.open = False
    span = time.perf_counter() - opened
    client_cpu = time.process_time() - client_before
    cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
    tpot_after = await asyncio.to_thread(engine_tpot, url)
    finished = tpot_after[1] - tpot_before[1]
    engine_ms = (tpot_after[0] - tpot_before[0]) * 1e3 / finished if finished else None
    running.clear()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*(s.closed for s in streams)), 60)
    p50 = percentile(window.tpot_ms, 50)
    mean = sum(window.tpot_ms) / len(window.tpot_ms) if window.tpot_ms else None
    return Result(
        step_ms, clients, tokens, span, window.tokens / span, window.events / span,
        window.tokens / window.events if window.events else 0.0, window.completed, window.wrong,
        p50, percentile(window.tpot_ms, 90), engine_ms,
        mean / engine_ms if mean is not None and engine_ms else None,
        cpu, sum(cpu.values()) * 1e6 / window.tokens if window.tokens and cpu else None,
        next(iter(cpu.values())) * 1e6 / window.events if window.events and cpu else None,
        client_cpu * 1e6 / window.tokens if window.tokens else None,
    )


# ---------------------------------------------------------------------- the fake server's process
def serve_fake(step_ms: float, host_ms: float, max_num_seqs: int, placement: str) -> None:
    """Serve the stand-in engine on a free port; print one JSON line with the URL and the pids."""
    from corelib.config.schema import LogLevel, ServerConfig
    from corelib.server.fake import FakeSpec
    from corelib.server.serve import bind, build_state, serve
    from corelib.server.served import EngineRecipe

    spec = FakeSpec(step_ms=step_ms, host_ms=host_ms, max_num_seqs=max_num_seqs)
    server = ServerConfig(port=0, log_level=LogLevel.warning, max_waiting=max_num_seqs)
    sock = bind(server.host, 0)
    state = build_state(EngineRecipe(fake=spec), server, None, "thread" if placement == "thread" else "process")
    host, port = sock.getsockname()[:2]

    def announce(line: str) -> None:
        if line.startswith("serving"):
            pids = {"http": os.getpid(), **({"engine": state.bridge.engine_pid} if state.bridge.engine_pid else {})}
            print(json.dumps({"url": f"http://{host}:{port}", "pids": pids}), flush=True)

    serve(state, server, sock, announce)


def _start_server(args: argparse.Namespace, step_ms: float) -> tuple[subprocess.Popen[str], str, dict[str, int]]:
    command = [sys.executable, "-m", "corelib.loadtest.streambench", "serve", f"--step-ms={step_ms}",
               f"--host-ms={args.host_ms}", f"--clients={args.clients}", f"--placement={args.placement}"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None, "Popen was asked for a stdout pipe"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    for line in process.stdout:
        if line.startswith("{"):
            announced = json.loads(line)
            return process, announced["url"], {k: int(v) for k, v in announced["pids"].items()}
        if time.monotonic() > deadline:
            break
    process.kill()
    raise SystemExit(f"streambench: the fake server did not start within {STARTUP_TIMEOUT_S:g} s (exit code "
                     f"{process.wait()})")


def _stop_server(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise SystemExit("streambench: the fake server did not stop within 30 s of SIGTERM") from None


def _row(result: Result) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    cpu = " ".join(f"{name} {seconds / result.seconds * 100:.0f}%" for name, seconds in result.server_cpu_s.items())
    per_token = "-" if result.server_cpu_us_per_token is None else f"{result.server_cpu_us_per_token:.1f}"
    per_event = "-" if result.http_cpu_us_per_event is None else f"{result.http_cpu_us_per_event:.1f}"
    client = "-" if result.client_cpu_us_per_token is None else f"{result.client_cpu_us_per_token:.1f}"
    ratio = "-" if result.tpot_over_engine is None else f"{result.tpot_over_engine:.3f}"
    return (f"{ms(result.step_ms):>8} {result.tokens_per_s:>9.0f} {result.events_per_s:>9.0f} "
            f"{result.tokens_per_event:>6.2f} {ms(result.tpot_ms_p50):>8}/{ms(result.tpot_ms_p90):<8} "
            f"{ms(result.engine_tpot_ms):>8} {ratio:>6} {per_token:>10} {per_event:>10} {client:>7}  {cpu}  "
            f"(answers {result.completed}, wrong {result.wrong})")


HEADER = (f"{'step ms':>8} {'tok/s':>9} {'events/s':>9} {'tok/ev':>6} {'TPOT p50/p90 ms':>17} {'engine':>8} "
          f"{'ratio':>6} {'srv us/tok':>10} {'http us/ev':>10} {'cli us':>7}  server CPU")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m corelib.loadtest.streambench", description=__doc__.split("\n")[0])
    parser.add_argument("mode", nargs="?", choices=["bench", "serve"], default="bench",
                        help="bench (default): start a fake server and load it; serve: only the server")
    parser.add_argument("--step-ms", help="the fake engine's step, ms (default 2); a comma list gives one row each; "
                        "with --url only a label")
    parser.add_argument("--host-ms", type=float, default=0.0, help="of each step, ms the fake spends holding the GIL")
    parser.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    parser.add_argument("--tokens", type=int, default=256, help="tokens each request asks for")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the measured window")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load before the window opens")
    parser.add_argument("--placement", choices=["process", "thread"], default="process",
                        help="the engine in a process of its own (default) or on a thread of the server's")
    parser.add_argument("--url", help="load this server instead of starting a fake one")
    parser.add_argument("--pid", type=int, action="append", default=[], help="with --url: the server's processes")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    steps = [float(s) for s in (args.step_ms or "2").split(",")]
    if args.mode == "serve":
        serve_fake(steps[0], args.host_ms, args.clients, args.placement)
        return 0
    results = []
    print(HEADER, flush=True)
    if args.url:
        pids = {f"pid {pid}": pid for pid in args.pid}
        results.append(asyncio.run(load(args.url, pids, args.clients, args.tokens, args.warmup, args.seconds,
                                        steps[0] if args.step_ms else None)))
        print(_row(results[-1]), flush=True)
    for step_ms in [] if args.url else steps:
        process, url, pids = _start_server(args, step_ms)
        try:
            results.append(asyncio.run(load(url, pids, args.clients, args.tokens, args.warmup, args.seconds,
                                            step_ms)))
        finally:
            _stop_server(process)
        print(_row(results[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
