"""A second Ctrl-C while the server drains ends the grace period at once, in one line and without a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from corelib.server.serve import FORCED_EXIT
from corelib.support import faults
from server.servekit import alive, announced, data_lines

pytestmark = [pytest.mark.slow, pytest.mark.long]  # a whole serve process: with the long checks

WAIT_S = 60.0  # how long a hang would take to show; the work itself takes seconds


def wait_for(check: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"{what} within {WAIT_S:g} s"
        time.sleep(0.01)


def test_a_second_ctrl_c_cuts_the_grace_period_short_in_one_line(tmp_path: Path) -> None:
    # The engine holds its 40th forward until the test creates the release file, so the request is
    # known to be running when the signals come, however fast the machine decodes; the grace period
    # is far longer than the test, so only the second Ctrl-C can end the request.
    release = tmp_path / "release"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", faults.ENV: "forward@40:hold", faults.RELEASE_ENV: str(release)}
    env.pop("CORELIB_API_KEY", None)
    command = [sys.executable, "-m", "corelib", "serve", "tiny", "--port", "0", "--uvicorn-log-level", "warning",
               "server.shutdown_grace_s=3600", f"hydra.run.dir={tmp_path / 'run'}"]
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    said: list[str] = []
    try:
        url, engine = announced(process)
        assert process.stderr is not None
        stderr = process.stderr
        listener = threading.Thread(target=lambda: said.extend(stderr), daemon=True)
        listener.start()
        lines: list[str] = []
        body = {"prompt": [0, 5, 6], "max_tokens": 400, "ignore_eos": True, "stream": True}

        def read() -> None:
            with httpx.stream("POST", f"{url}/completions", json=body, timeout=WAIT_S) as stream:
                lines.extend(stream.iter_lines())

        reader = threading.Thread(target=read)
        reader.start()
        held = Path(f"{release}.held")
        wait_for(lambda: held.exists() and data_lines(lines), "the request did not reach the held forward")
        os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole group
        wait_for(lambda: "Shutting down" in "".join(said) or not healthy(url), "the server did not drain")
        os.killpg(process.pid, signal.SIGINT)
        wait_for(lambda: any(FORCED_EXIT in line for line in said), "the second Ctrl-C was not taken")
        release.touch()
        reader.join(WAIT_S)
        assert not reader.is_alive(), "the stream did not end after the second Ctrl-C"
        events = data_lines(lines)
        assert events[-1] == "[DONE]"
        assert "shutting down" in json.loads(events[-2])["error"]["message"]
        assert process.wait(WAIT_S) == 130
        listener.join(WAIT_S)
        assert not alive(engine), "the engine process outlived the server"
    finally:
        process.kill()
        process.wait()
    text = "".join(said)
    assert "Traceback" not in text and "CancelledError" not in text, text
    assert text.count(FORCED_EXIT) == 1


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url.removesuffix('/v1')}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
