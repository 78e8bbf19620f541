"""Clients that hang up, and a server that is told to stop: nothing is left held, nobody waits forever."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from corelib.config.schema import LogLevel, ServerConfig
from corelib.server.serve import RunningServer, start_in_thread
from corelib.support import faults
from server.servekit import alive, announced, data_lines, finished, metrics, wait_idle

pytestmark = pytest.mark.slow

LONG = {"prompt": [0, 5, 6, 7], "max_tokens": 240, "ignore_eos": True}


def test_clients_that_hang_up_mid_stream_are_aborted_and_their_blocks_returned(server: RunningServer) -> None:
    aborted, completed = finished(server.url, "abort"), finished(server.url, "length")
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for _ in range(8):
            with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream:
                events = 0
                for _line in stream.iter_lines():
                    events += _line.startswith("data: ")
                    if events == 3:
                        break  # leaving the block closes the connection mid-stream
    figures = wait_idle(server.url)
    assert figures["corelib_kv_blocks_free"] == figures["corelib_kv_blocks_total"] > 0
    assert finished(server.url, "abort") == aborted + 8
    assert finished(server.url, "length") == completed, "no hung-up request may run to its end"


def test_a_client_that_gives_up_on_a_whole_response_is_aborted(
    overrides: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine runs on a thread of this process, so a gate can hold its second forward: the client
    # hangs up while its request is known to be running, however fast this machine decodes.
    config = ServerConfig(port=0, log_level=LogLevel.warning)
    with start_in_thread(overrides, config, placement="thread") as running:
        aborted, completed = finished(running.url, "abort"), finished(running.url, "length")
        bridge = running.state.bridge
        abort_sent = threading.Event()
        send_abort = bridge.abort

        def abort(request_ids: list[str]) -> None:
            send_abort(request_ids)
            abort_sent.set()

        monkeypatch.setattr(bridge, "abort", abort)
        body = json.dumps(LONG).encode()
        host, port = running.url.removeprefix("http://").split(":")
        with faults.gate("forward", hit=2) as held:
            with socket.create_connection((host, int(port)), timeout=30) as client:
                client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                assert held.reached.wait(30), "the request's second step never ran"
            # The client has hung up on a request that cannot have finished: the engine is held.
            assert abort_sent.wait(30), "the server never asked the engine to abort the request"
        wait_idle(running.url)
        assert finished(running.url, "abort") == aborted + 1
        assert finished(running.url, "length") == completed


def test_stopping_lets_a_running_request_finish_within_the_grace_period(overrides: list[str]) -> None:
    running = start_in_thread(overrides, ServerConfig(port=0, log_level=LogLevel.warning, shutdown_grace_s=30))
    lines: list[str] = []

    def read() -> None:
        body = {"prompt": [0, 5, 6], "max_tokens": 24, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{running.url}/v1/completions", json=body, timeout=30) as stream:
            lines.extend(stream.iter_lines())

    reader = threading.Thread(target=read)
    reader.start()
    while not lines and reader.is_alive():
        time.sleep(0.01)
    running.stop()
    reader.join(30)
    events = data_lines(lines)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert not running._thread.is_alive()


@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=pytest.mark.long)],  # streamed: long checks
                         ids=["whole", "streamed"])
def test_an_engine_failure_ends_the_request_with_it_and_the_server_says_so(
    overrides: list[str], stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {"prompt": [0, 5, 6], "max_tokens": 40, "ignore_eos": True, "stream": stream}
    monkeypatch.setenv(faults.ENV, "forward@8")  # read by the engine process when it starts
    config = ServerConfig(port=0, log_level=LogLevel.warning)
    with start_in_thread([*overrides, "engine.timeout_s=5"], config) as running:
        with httpx.stream("POST", f"{running.url}/v1/completions", json=body, timeout=30) as response:
            status, lines = response.status_code, list(response.iter_lines())
        if stream:
            events = data_lines(lines)
            assert status == 200 and events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
        else:
            assert status == 500
            error = json.loads("".join(lines))["error"]
        assert error["type"] == "server_error" and "InjectedFault" in error["message"]
        health = httpx.get(f"{running.url}/health")
        assert health.status_code == 503 and "InjectedFault" in health.json()["reason"]
        later = httpx.post(f"{running.url}/v1/completions", json=body)
        assert later.status_code == 503 and "stopped after an error" in later.json()["error"]["message"]
        assert metrics(running.url)["corelib_engine_up"] == 0


def healthy(url: str) -> bool:
    """``GET /health`` answers 200: the server has not taken a stop signal (it drains, or stopped listening)."""
    try:
        return httpx.get(f"{url.removesuffix('/v1')}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize(("stop", "code", "said"), [
    ("sigterm", 128 + signal.SIGTERM, "corelib: terminated (SIGTERM)"),  # a service manager: the main process
    pytest.param("ctrl-c", 130, "corelib: interrupted", marks=pytest.mark.long),  # a terminal: the whole group,
], ids=["sigterm", "ctrl-c"])  # the engine process too (a serve process each: the second with the long checks)
def test_a_stop_signal_aborts_what_runs_with_a_reason_and_ends_the_engine_process(
    tmp_path: Path, stop: str, code: int, said: str
) -> None:
    # The engine process holds its 40th forward (past the graph captures, one forward per batch-size
    # bucket, and well inside the request's 400 tokens) until the test creates the release file: the
    # signal arrives while the request is known to be running, however fast this machine decodes.
    # No grace period: once released, the request is aborted at the next step, never run to its end.
    release = tmp_path / "release"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", faults.ENV: "forward@40:hold", faults.RELEASE_ENV: str(release)}
    env.pop("CORELIB_API_KEY", None)
    command = [sys.executable, "-m", "corelib", "serve", "backend=npu", "server.port=0", "server.log_level=warning",
               "server.shutdown_grace_s=0", f"hydra.run.dir={tmp_path / 'run'}"]
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        url, engine = announced(process)
        assert alive(engine)
        lines: list[str] = []
        body = {"prompt": [0, 5, 6], "max_tokens": 400, "ignore_eos": True, "stream": True}

        def read() -> None:
            with httpx.stream("POST", f"{url}/completions", json=body, timeout=30) as stream:
                lines.extend(stream.iter_lines())

        reader = threading.Thread(target=read)
        reader.start()
        held = Path(f"{release}.held")
        deadline = time.monotonic() + 60
        while not (held.exists() and data_lines(lines)) and reader.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held.exists() and data_lines(lines), "the request never reached the held forward"
        if stop == "sigterm":
            process.send_signal(signal.SIGTERM)
        else:
            os.killpg(process.pid, signal.SIGINT)
        while time.monotonic() < deadline and healthy(url):  # the server took the signal: it drains
            time.sleep(0.01)
        release.touch()
        reader.join(20)
        assert not reader.is_alive(), "the stream did not end after the signal"
        events = data_lines(lines)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
        assert process.wait(20) == code
        assert not alive(engine), "the engine process outlived the server"
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/models", timeout=2)
    finally:
        process.kill()
        _, stderr = process.communicate()
    assert said in stderr
    assert "Traceback" not in stderr, stderr
