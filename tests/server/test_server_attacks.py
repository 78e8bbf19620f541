"""A hostile client, checkpoint or environment against the HTTP server: each gets one clear answer, and the server keeps
serving (``/health`` answers while the attack is in progress, held there by a gate)."""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import Cli, assert_user_error

from corelib.config.schema import LogLevel, ServerConfig
from corelib.errors import ConfigError
from corelib.server.serve import RunningServer, start_in_thread
from corelib.support import faults
from server.test_server_errors import error_of

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("key", ["", pytest.param("  ", marks=pytest.mark.long),  # each: a server start;
                                 pytest.param("key\n", marks=pytest.mark.long),  # three with the long checks
                                 pytest.param(" key", marks=pytest.mark.long)])
def test_an_empty_or_broken_api_key_never_means_no_authentication(cli: Cli, key: str) -> None:
    # CORELIB_API_KEY=$(cat key.txt) with key.txt missing sets the variable to "".
    result = cli("serve", "backend=cpu", "server.port=0", env={"CORELIB_API_KEY": key})
    assert_user_error(result, "server.api_key")
    with pytest.raises(ConfigError, match=r"server\.api_key"):
        start_in_thread(["backend=cpu"], ServerConfig(port=0), api_key=key)


def test_the_command_line_cannot_give_an_empty_key_either(cli: Cli, tmp_path: Path) -> None:
    result = cli("serve", "backend=cpu", "server.port=0", "server.api_key=''")
    assert_user_error(result, "server.api_key is set but empty")
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("plan.json"))


# ---------------------------------------------------------------------- a server under attack
# Its chat template is benign on the one-message probe at start and loops for ever once a conversation has two
# messages: a checkpoint's template is code from elsewhere.
HOSTILE_TEMPLATE = ("{% if messages|length > 1 %}{% for i in range(100000) %}{% for j in range(100000) %}"
                    "{% endfor %}{% endfor %}{% endif %}{{ messages[0]['content'] }}")
HEADER_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 12


@pytest.fixture(scope="module")
def attacked(overrides: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    template = tmp_path_factory.mktemp("hostile") / "template.jinja"
    template.write_text(HOSTILE_TEMPLATE)
    config = ServerConfig(port=0, log_level=LogLevel.warning, served_model_name="m", chat_template=str(template),
                          max_body_mib=0.25, header_timeout_s=HEADER_TIMEOUT_S, max_connections=MAX_CONNECTIONS)
    running = start_in_thread(overrides, config, placement="thread")  # faults reach its engine thread
    yield running
    running.stop()


def healthy(url: str) -> None:
    """/health answers, and a request is served: the event loop and the engine are both free."""
    response = httpx.get(f"{url}/health", timeout=30)
    assert response.status_code == 200, response.text
    done = httpx.post(f"{url}/v1/completions", json={"prompt": [0, 5], "max_tokens": 2}, timeout=60)
    assert done.status_code == 200, done.text


def test_a_hostile_template_renders_off_the_event_loop_and_ends_in_a_400(attacked: RunningServer) -> None:
    conversation = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    answers: list[httpx.Response] = []
    with faults.gate("render") as held:
        hostile = threading.Thread(target=lambda: answers.append(
            httpx.post(f"{attacked.url}/v1/chat/completions", json=conversation, timeout=120)))
        hostile.start()
        assert held.reached.wait(60), "the render never started"
        healthy(attacked.url)  # while the hostile render is in progress
    hostile.join(120)
    error = error_of(answers[0], 400)
    assert error["param"] == "messages" and "did not render within" in str(error["message"])
    one = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert httpx.post(f"{attacked.url}/v1/chat/completions", json=one, timeout=60).status_code == 200


def test_a_prompt_longer_than_any_context_is_refused_before_it_is_tokenized(
    attacked: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = attacked.state.bridge.info
    tokenizer = info.tokenizer
    assert tokenizer is not None
    encoded: list[str] = []
    encode = tokenizer.encode

    def recording(text: str, add_special_tokens: bool = True) -> list[int]:
        encoded.append(threading.current_thread().name)
        return encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", recording)
    response = httpx.post(f"{attacked.url}/v1/completions", json={"prompt": "x" * (info.max_prompt_chars + 1)})
    assert f"holds at most {info.max_prompt_chars} characters" in str(error_of(response, 400)["message"])
    assert not encoded, "the prompt was tokenized"
    assert httpx.post(f"{attacked.url}/v1/completions", json={"prompt": "hello", "max_tokens": 2}).status_code == 200
    assert encoded and "corelib-http" not in encoded, f"tokenized on the event loop's thread: {encoded}"


@pytest.mark.parametrize("declared", [True, False])
def test_a_body_over_the_limit_is_a_413_and_not_read(attacked: RunningServer, declared: bool) -> None:
    limit = attacked.state.max_body_bytes
    body = b'{"prompt": "' + b"x" * limit + b'"}'
    if declared:
        response = httpx.post(f"{attacked.url}/v1/completions", content=body, timeout=60)
    else:  # chunked: no Content-Length to refuse it by, so it is counted as it arrives
        response = httpx.post(f"{attacked.url}/v1/completions", content=iter([body[:1000], body[1000:]]), timeout=60)
    assert error_of(response, 413)["code"] == "request_too_large"
    healthy(attacked.url)


@pytest.mark.parametrize(("body", "param", "fragment"), [
    (b'{"prompt": "a\\ud800b"}', "prompt", "lone UTF-16 surrogate"),
    (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages.0.content", "lone UTF-16 surrogate"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "nested too deeply"),
    (b'{"messages": [' + b",".join([b'{"role": "user", "content": "a"}'] * 5000) + b"]}", "messages",
     "at most 4096"),
    (b'{"prompt": [' + b"7" * 5000 + b"]}", None, "4300 digits"),
    (b'{"prompt": "x", "max_tokens": "5"}', "max_tokens", "valid integer"),
    (b'{"prompt": "x", "max_tokens": true}', "max_tokens", "valid integer"),
    (b'{"prompt": [true, false]}', "prompt", "token ids"),
    (b'{"prompt": [1.0, 2.0]}', "prompt", "token ids"),
    (b'{"prompt": "x", "n": 2.0}', "n", "must be an integer"),
    (b'{"prompt": "x", "stream": "yes"}', "stream", "valid boolean"),
])
def test_json_python_cannot_hold_and_lax_types_are_400s(
    attacked: RunningServer, body: bytes, param: str | None, fragment: str
) -> None:
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    error = error_of(httpx.post(f"{attacked.url}{path}", content=body, timeout=60), 400)
    assert error["param"] == param and fragment in str(error["message"]), error


def test_a_trailing_slash_is_a_404_not_a_redirect_to_the_clients_host(attacked: RunningServer) -> None:
    response = httpx.get(f"{attacked.url}/v1/models/", headers={"Host": "attacker.example"})
    assert response.status_code == 404 and "location" not in response.headers


def _slow_client(url: str, request: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(request)
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1 << 16) == b""
    except (ConnectionResetError, TimeoutError):
        return isinstance(sys.exc_info()[1], ConnectionResetError)


@pytest.mark.parametrize("stalls_in", ["headers", "body"])
def test_a_slow_client_is_closed_and_the_connection_cap_holds(attacked: RunningServer, stalls_in: str) -> None:
    start = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    if stalls_in == "body":
        start += b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\""
    slow = [_slow_client(attacked.url, start) for _ in range(MAX_CONNECTIONS)]
    try:
        beyond = _slow_client(attacked.url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _closed_by_server(beyond), "a connection beyond server.max_connections was kept"
        beyond.close()
        for sock in slow:  # each is closed once it has taken server.header_timeout_s without finishing
            assert _closed_by_server(sock), "a slow client was kept open"
    finally:
        for sock in slow:
            sock.close()
    healthy(attacked.url)


def test_a_request_whose_packing_fails_fails_alone_and_the_server_keeps_serving(attacked: RunningServer) -> None:
    body = {"prompt": [0, 5, 6], "max_tokens": 3, "ignore_eos": True}
    with faults.injected("pack@1"):
        refused = httpx.post(f"{attacked.url}/v1/completions", json=body, timeout=60)
        served = httpx.post(f"{attacked.url}/v1/completions", json=body, timeout=60)
    assert "cannot be packed into a step" in str(error_of(refused, 400)["message"])
    assert served.status_code == 200, served.text
    healthy(attacked.url)
