"""A worker killed while nothing runs: /health says so (an idle engine is asked, and looks), and the next request
is refused with 503 naming the worker, not failed with a 500 (the periodic idle check may not have run)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from corelib.config.schema import LogLevel, ServerConfig
from corelib.server.serve import RunningServer, start_in_thread
from server.servekit import alive
from server.test_server_errors import error_of

pytestmark = pytest.mark.slow

CONFIG = ServerConfig(port=0, log_level=LogLevel.warning, served_model_name="m")


def kill_the_worker(running: RunningServer) -> str:
    """SIGKILL the engine's one worker and wait until it is dead (a zombie its engine has not waited for yet)."""
    engine = running.state.bridge.engine_pid
    assert engine is not None
    found: set[int] = set()
    for thread in Path(f"/proc/{engine}/task").iterdir():
        found.update(int(child) for child in (thread / "children").read_text().split())
    [worker] = [child for child in found if alive(child)]
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while alive(worker):
        assert time.monotonic() < deadline, f"worker {worker} outlived SIGKILL"
        time.sleep(0.01)
    return f"worker rank 0 (pid {worker}) was killed by SIGKILL"


@pytest.mark.long  # a server and a killed worker, 9 s on 2 cores (the next test kills one in the default run)
def test_health_notices_a_worker_killed_while_nothing_runs(overrides: list[str]) -> None:
    with start_in_thread([*overrides, "engine.transport=shm"], CONFIG) as running:
        served = httpx.post(f"{running.url}/v1/completions", json={"prompt": [0, 5], "max_tokens": 2}, timeout=60)
        assert served.status_code == 200, served.text
        why = kill_the_worker(running)
        # /health asks the idle engine, which looks at its workers first; on a busy machine its answer may
        # come after /health stopped waiting for it (then the next ask, or the engine's own check, tells).
        deadline = time.monotonic() + 60
        while (health := httpx.get(f"{running.url}/health", timeout=30)).status_code == 200:
            assert time.monotonic() < deadline, "/health never noticed the dead worker"
            time.sleep(0.05)
        assert health.status_code == 503 and why in health.json()["reason"], health.text
        later = httpx.post(f"{running.url}/v1/completions", json={"prompt": [0, 5], "max_tokens": 2}, timeout=60)
        error = error_of(later, 503)
        assert error["type"] == "service_unavailable" and why in str(error["message"])


def test_a_request_after_a_worker_died_unseen_is_refused_not_failed(overrides: list[str]) -> None:
    with start_in_thread([*overrides, "engine.transport=shm"], CONFIG) as running:
        why = kill_the_worker(running)
        later = httpx.post(f"{running.url}/v1/completions", json={"prompt": [0, 5], "max_tokens": 2}, timeout=60)
        error = error_of(later, 503)
        assert error["type"] == "service_unavailable" and why in str(error["message"])
