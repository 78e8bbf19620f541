"""The HTTP process of ``python -m corelib serve`` never loads torch: the engine process starts, plans and runs.

Whether a process loaded torch shows in its memory map (``/proc/PID/maps`` lists libtorch once
``import torch`` ran); the engine process's map is the control that the check sees torch where
it is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server.servekit import announced

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/PID/maps")]


def loaded_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.long  # a whole serve process, 11 s on 2 cores: with the long checks
def test_the_http_process_never_loads_torch(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CORELIB_API_KEY", None)
    command = [sys.executable, "-m", "corelib", "serve", "backend=cpu", "server.port=0", "server.log_level=warning",
               "server.api_key=secret", f"hydra.run.dir={run_dir}"]
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        url, engine = announced(process)
        assert loaded_torch(engine), "the engine process runs the model: torch shows in its map"
        assert not loaded_torch(process.pid), "the HTTP process loaded torch before serving"
        body = {"prompt": [3, 4, 5], "max_tokens": 4, "ignore_eos": True}
        reply = httpx.post(f"{url}/completions", json=body, headers={"Authorization": "Bearer secret"}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        assert not loaded_torch(process.pid), "the HTTP process loaded torch while serving a request"
        # The engine process recorded the startup, without the key.
        plan = json.loads((run_dir / "plan.json").read_text())
        assert plan["backend"] == "cpu" and "async_token_handoff" in plan["features"]
        config = (run_dir / "config.yaml").read_text()
        assert "secret" not in config and "api_key: <set>" in config
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 128 + signal.SIGTERM
    finally:
        process.kill()
        _, stderr = process.communicate()
    assert "Traceback" not in stderr, stderr


def test_a_refused_plan_crosses_from_the_engine_process_whole() -> None:
    import pickle

    from corelib.errors import PlanRefused

    refused = PlanRefused([("engine.graph=on", "the device cannot capture graphs")])
    again = pickle.loads(pickle.dumps(refused))
    assert isinstance(again, PlanRefused) and again.unmet == refused.unmet and again.exit_code == 2
    assert str(again) == str(refused)
