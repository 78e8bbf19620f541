"""How fast ``/health`` answers while the server is under each HTTP attack of the second security pass.

A server (a tiny random text checkpoint with a chat template that loops for ever on a second
message, the emulated npu, the engine in its own process) is attacked one way at a time, each
attack kept up for a few seconds by client threads, while another thread asks for ``/health``
every 20 ms. Each attack's ``/health`` latencies (p50, p99, max) are printed, and whether every
one was under the target. Nothing here is a test: the figures depend on the machine.

    python3 benchmarks/health_under_attack.py [--seconds 4] [--target-ms 100] [--out health.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

import httpx

from corelib.config.schema import LogLevel, ServerConfig
from corelib.models.synthetic import write_text_checkpoint
from corelib.server.serve import start_in_thread

LOOPING_TEMPLATE = ("{% if messages|length > 1 %}{% for i in range(100000) %}{% for j in range(100000) %}"
                    "{% endfor %}{% endfor %}{% endif %}{{ messages[0]['content'] }}")


def attacks(url: str, max_chars: int, max_body: int) -> dict[str, Callable[[], None]]:
    """Each attack as one hostile request (or connection); the caller repeats it from a few threads."""
    host, port = url.removeprefix("http://").split(":")

    def post(path: str, content: bytes) -> None:
        with contextlib.suppress(httpx.HTTPError):  # the server may close a hostile connection: an answer too
            httpx.post(f"{url}{path}", content=content, headers={"content-type": "application/json"}, timeout=60)

    def slow_headers() -> None:
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            with contextlib.suppress(OSError):
                sock.recv(1 << 16)  # until the server gives up on the headers

    two_messages = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})
    return {
        "a template that loops for ever": lambda: post("/v1/chat/completions", two_messages.encode()),
        "a prompt longer than any context": lambda: post(
            "/v1/completions", json.dumps({"prompt": "x" * (max_chars + 1)}).encode()),
        "a body over the limit": lambda: post("/v1/completions", b'{"prompt": "' + b"x" * max_body + b'"}'),
        "JSON nested 100,000 deep": lambda: post("/v1/completions", b'{"prompt": ' + b"[" * 100_000
                                                 + b"]" * 100_000 + b"}"),
        "5,000 messages": lambda: post("/v1/chat/completions", b'{"messages": [' + b",".join(
            [b'{"role": "user", "content": "a"}'] * 5000) + b"]}"),
        "an integer of 100,000 digits": lambda: post("/v1/completions",
                                                     b'{"prompt": "x", "max_tokens": ' + b"9" * 100_000 + b"}"),
        "a lone UTF-16 surrogate": lambda: post("/v1/completions", b'{"prompt": "a\\ud800b"}'),
        "slow clients holding headers": slow_headers,
        "40,000 prompts x n=128": lambda: post("/v1/completions", b'{"n": 128, "prompt": [' + b",".join(
            [b"[5]"] * 40_000) + b"]}"),
        "8,000 content parts": lambda: post("/v1/chat/completions", b'{"messages": [{"role": "user", "content": ['
                                            + b",".join([b'{"type":"text","text":"a"}'] * 8000) + b"]}]}"),
        "50,000 stop strings": lambda: post("/v1/completions", b'{"prompt": "x", "stop": [' + b",".join(
            [b'"a"'] * 50_000) + b"]}"),
    }


def probe(url: str, stop: threading.Event, latencies: list[float], failures: list[str]) -> None:
    """Ask for /health every 20 ms until ``stop``; each answer's latency in ms."""
    with httpx.Client(base_url=url, timeout=10) as client:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                status = client.get("/health").status_code
            except httpx.HTTPError as error:
                failures.append(type(error).__name__)
                status = 0
            latencies.append((time.perf_counter() - started) * 1e3)
            if status != 200:
                failures.append(f"status {status}")
            stop.wait(0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=4.0, help="how long each attack is kept up")
    parser.add_argument("--clients", type=int, default=4, help="threads repeating the attack")
    parser.add_argument("--target-ms", type=float, default=100.0)
    parser.add_argument("--only", default="", help="run only the attacks whose name holds this text")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = write_text_checkpoint(Path(folder) / "model")
        template = Path(folder) / "template.jinja"
        template.write_text(LOOPING_TEMPLATE)
        config = ServerConfig(port=0, log_level=LogLevel.warning, served_model_name="m", chat_template=str(template),
                              max_body_mib=0.25, header_timeout_s=1.0, max_connections=12)
        running = start_in_thread(["backend=npu", f"model.path={model}"], config)
        try:
            info = running.state.bridge.info
            rows: dict[str, Row] = {}
            baseline: list[float] = []
            stop = threading.Event()
            failures: list[str] = []
            prober = threading.Thread(target=probe, args=(running.url, stop, baseline, failures))
            prober.start()
            time.sleep(args.seconds)
            stop.set()
            prober.join()
            rows["no attack"] = summary(baseline, failures)
            for name, attack in attacks(running.url, info.max_prompt_chars, running.state.max_body_bytes).items():
                if args.only in name:
                    rows[name] = under(running.url, attack, args.seconds, args.clients)
        finally:
            running.stop()
    worst = max(row["max_ms"] for row in rows.values())
    print(f"{'attack':<36} {'probes':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}  failures")
    for name, row in rows.items():
        print(f"{name:<36} {row['probes']:>6} {row['p50_ms']:>8.1f} {row['p99_ms']:>8.1f} {row['max_ms']:>8.1f}"
              f"  {row['failures'] or '-'}")
    print(f"every /health answer within {args.target_ms:.0f} ms: {'yes' if worst <= args.target_ms else 'no'}"
          f" (slowest {worst:.1f} ms)")
    if args.out:
        Path(args.out).write_text(json.dumps({"target_ms": args.target_ms, "attacks": rows}, indent=1))


def under(url: str, attack: Callable[[], None], seconds: float, clients: int) -> Row:
    """/health latencies while ``clients`` threads repeat ``attack`` for ``seconds``."""
    stop = threading.Event()
    latencies: list[float] = []
    failures: list[str] = []
    deadline = time.monotonic() + seconds

    def hostile() -> None:
        while time.monotonic() < deadline:
            attack()

    attackers = [threading.Thread(target=hostile, daemon=True) for _ in range(clients)]
    for thread in attackers:
        thread.start()
    prober = threading.Thread(target=probe, args=(url, stop, latencies, failures))
    prober.start()
    for thread in attackers:
        thread.join(seconds + 120)
    stop.set()
    prober.join()
    return summary(latencies, failures)


class Row(TypedDict):
    probes: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    failures: list[str]


def summary(latencies: list[float], failures: list[str]) -> Row:
    ordered = sorted(latencies) or [float("nan")]
    return {"probes": len(latencies), "p50_ms": statistics.median(ordered),
            "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], "max_ms": ordered[-1],
            "failures": sorted(set(failures))}


if __name__ == "__main__":
    main()
