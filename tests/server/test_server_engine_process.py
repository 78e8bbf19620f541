"""The engine in a process of its own: it serves, it is never left behind, and its death is reported.

These serve the stand-in engine of corelib.server.fake (no model), so each starts in seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from corelib.config.schema import LogLevel, ServerConfig
from corelib.errors import ConfigError
from corelib.server.fake import FakeSpec
from corelib.server.serve import RunningServer, start_in_thread
from corelib.server.served import EngineRecipe
from server.servekit import data_lines, metrics

pytestmark = pytest.mark.slow

CONFIG = ServerConfig(port=0, log_level=LogLevel.warning, max_waiting=64)


def fake(step_ms: float = 2.0) -> EngineRecipe:
    return EngineRecipe(fake=FakeSpec(step_ms=step_ms))


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's parent may be slow to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def children() -> set[int]:
    pids: set[int] = set()
    for thread in Path(f"/proc/{os.getpid()}/task").iterdir():
        pids.update(int(pid) for pid in (thread / "children").read_text().split())
    return {pid for pid in pids if alive(pid)}


def stream_tokens(url: str, max_tokens: int) -> tuple[int, str | None, list[str]]:
    """(tokens received, finish_reason, SSE payloads) of one streamed completion."""
    body = {"prompt": [5, 6, 7], "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        events = data_lines(response.iter_lines())
    tokens, reason = 0, None
    for payload in events[:-1]:
        choice = json.loads(payload)["choices"][0]
        tokens += choice["text"].count("<")
        reason = choice["finish_reason"] or reason
    return tokens, reason, events


@pytest.fixture(scope="module")
def served() -> Iterator[RunningServer]:
    with start_in_thread(fake(), CONFIG) as running:
        yield running


def test_the_engine_runs_in_a_process_of_its_own_and_every_stream_gets_all_its_tokens(served: RunningServer) -> None:
    pid = served.state.bridge.engine_pid
    assert pid is not None and pid != os.getpid() and alive(pid)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda n: stream_tokens(served.url, n), range(20, 36)))
    assert [(tokens, reason) for tokens, reason, _ in results] == [(n, "length") for n in range(20, 36)]
    assert all(events[-1] == "[DONE]" for _, _, events in results)


def test_stopping_the_server_ends_its_engine_process() -> None:
    running = start_in_thread(fake(), CONFIG)
    pid = running.state.bridge.engine_pid
    assert pid is not None and alive(pid)
    running.stop()
    assert not alive(pid)


def test_the_engine_can_run_on_a_thread_of_the_server_instead() -> None:
    with start_in_thread(fake(), CONFIG, placement="thread") as running:
        assert running.state.bridge.engine_pid is None
        assert stream_tokens(running.url, 12)[:2] == (12, "length")


def test_when_the_engine_process_dies_streams_end_with_how_and_the_server_says_so() -> None:
    with start_in_thread(fake(step_ms=5.0), CONFIG) as running:
        pid = running.state.bridge.engine_pid
        assert pid is not None
        body = {"prompt": [5, 6], "max_tokens": 2000, "stream": True}
        lines: list[str] = []
        with httpx.stream("POST", f"{running.url}/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                lines.append(line)
                if len(data_lines(lines)) == 3:
                    os.kill(pid, signal.SIGKILL)
        events = data_lines(lines)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        why = f"the engine process (pid {pid}) was killed by SIGKILL"
        assert error["type"] == "server_error" and why in error["message"]
        health = httpx.get(f"{running.url}/health")
        assert health.status_code == 503 and why in health.json()["reason"]
        later = httpx.post(f"{running.url}/v1/completions", json={"prompt": [5], "max_tokens": 2})
        assert later.status_code == 503 and why in later.json()["error"]["message"]
        assert metrics(running.url)["corelib_engine_up"] == 0


@pytest.mark.slow
def test_an_engine_that_cannot_be_built_fails_the_start_with_its_error_and_leaves_no_process() -> None:
    before = children()
    with pytest.raises(ConfigError, match=r"engine.max_num_seqs=0: must be at least 1"):
        start_in_thread(["backend=npu", "engine.max_num_seqs=0"], CONFIG)
    assert children() == before


SERVER = textwrap.dedent("""
    import sys, time
    from corelib.config.schema import LogLevel, ServerConfig
    from corelib.server.fake import FakeSpec
    from corelib.server.serve import start_in_thread
    from corelib.server.served import EngineRecipe
    running = start_in_thread(EngineRecipe(fake=FakeSpec()), ServerConfig(port=0, log_level=LogLevel.warning))
    print(running.url, running.state.bridge.engine_pid, flush=True)
    time.sleep(600)
""")


@pytest.mark.slow
def test_when_the_server_process_is_killed_its_engine_process_exits() -> None:
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        url, pid = server.stdout.readline().split()
        engine = int(pid)
        assert alive(engine)
        with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": [5], "max_tokens": 2000, "stream": True},
                          timeout=30) as response:
            next(response.iter_lines())  # a request is running when the server dies
            server.kill()
            server.wait(10)
        deadline = time.monotonic() + 20
        while alive(engine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(engine), "the engine process outlived its server by 20 s"
    finally:
        server.kill()
        server.wait()
