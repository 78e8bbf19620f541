"""What a client that gets something wrong, or comes at a bad time, is told: 400, 401, 404, 429."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest

from corelib.cli.main import main
from corelib.config.schema import LogLevel, ServerConfig
from corelib.server.serve import RunningServer, start_in_thread
from server.servekit import metrics, wait_idle

KEY = "sekret-key"


def error_of(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "Traceback" not in response.text
    error: dict[str, object] = body["error"]
    return error


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"prompt": "x", "temperature": -1}, "temperature", "temperature=-1"),
        ({"prompt": "x", "temperature": "hot"}, "temperature", "must be a number"),
        ({"prompt": "x", "temperature": 3.5e38}, "temperature", "float32"),
        ({"prompt": "x", "top_k": 2**63}, "top_k", "int64"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "> 0"),
        ({"prompt": "x", "n": 0}, "n", "at least 1"),
        ({"prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "at least 1"),
        ({"prompt": "x", "max_tokens": 100_000}, "max_tokens", "at most"),
        ({"prompt": "x", "seed": -3}, "seed", "2**62"),
        ({"prompt": "x", "stop": [""]}, "stop", "empty string"),
        ({"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids", "outside the vocabulary"),
        ({"prompt": [0, 99999]}, "prompt", "outside the vocabulary"),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": [[1.5]]}, "prompt", "token ids"),
        ({"prompt": "x " * 400}, "prompt", "leaves no room"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", "must be in [0, 20]"),
        ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs", "must be in [0, 20]"),
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not streamed"),
        ({"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, "echo", "not streamed"),
        ({"prompt": "x", "best_of": 2}, "best_of", "not supported"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"prompt": "x", "temprature": 0.5}, "temprature", "not a parameter"),
        ({"max_tokens": 3}, "prompt", "required"),
        ({"prompt": [[0, 5]] * 65, "n": 2}, "n", "at most 128 requests at once"),
    ],
)
def test_a_bad_completion_request_is_a_400_naming_the_field(
    server: RunningServer, body: dict[str, object], param: str, fragment: str
) -> None:
    error = error_of(httpx.post(f"{server.url}/v1/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert fragment in str(error["message"])


@pytest.mark.parametrize(
    ("messages", "param", "fragment"),
    [
        ([], "messages", "at least 1"),
        ([{"role": "robot", "content": "x"}], "messages.0.role", "'user'"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages.0.content",
         "only text"),
        ([{"role": "tool", "content": "x"}], "messages", "this template has no tool role"),
    ],
)
def test_a_bad_chat_request_is_a_400_naming_the_field(
    server: RunningServer, messages: list[object], param: str, fragment: str
) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages})
    error = error_of(response, 400)
    assert error["param"] == param and fragment in str(error["message"])


def test_a_body_that_is_not_json_is_a_400(server: RunningServer) -> None:
    headers = {"content-type": "application/json"}
    response = httpx.post(f"{server.url}/v1/completions", content=b"{prompt", headers=headers)
    assert "not valid JSON" in str(error_of(response, 400)["message"])


def test_an_unknown_route_is_an_openai_style_404(server: RunningServer) -> None:
    error = error_of(httpx.get(f"{server.url}/v1/engines"), 404)
    assert "/v1/engines" in str(error["message"])


def test_the_openai_client_raises_bad_request_with_the_param(server: RunningServer) -> None:
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(model="chat-model", prompt="x", temperature=-0.5)
    assert refused.value.param == "temperature"


@pytest.fixture(scope="module")
def guarded(overrides: list[str]) -> Iterator[RunningServer]:
    """One request decodes, one waits, more are refused; every /v1 request needs the key."""
    config = ServerConfig(port=0, log_level=LogLevel.warning, max_waiting=1, served_model_name="m")
    running = start_in_thread([*overrides, "engine.max_num_seqs=1"], config, api_key=KEY)
    yield running
    running.stop()


@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {KEY}", KEY])
def test_without_the_right_key_a_request_is_401(guarded: RunningServer, header: str | None) -> None:
    headers = {"Authorization": header} if header else {}
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
        response = httpx.request(method, f"{guarded.url}{path}", json={"prompt": "x"}, headers=headers)
        error = error_of(response, 401)
        assert error["code"] == "invalid_api_key" and response.headers["www-authenticate"] == "Bearer"


def test_with_the_key_requests_pass_and_health_needs_none(guarded: RunningServer) -> None:
    api = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY, max_retries=0)
    # greedy: at the API's default temperature (1) and no seed, the random model draws its EOS now and then
    done = api.completions.create(model="m", prompt=[0, 5], max_tokens=2, temperature=0)
    assert done.choices[0].finish_reason == "length"
    assert httpx.get(f"{guarded.url}/health").status_code == 200


def test_beyond_running_and_waiting_a_request_is_429_and_served_once_there_is_room(guarded: RunningServer) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": [0, 5, 6], "max_tokens": 200, "stream": True, "ignore_eos": True}
    with ExitStack() as streams, httpx.Client(base_url=guarded.url, headers=headers, timeout=30) as http:
        for _ in range(2):  # one decodes, one waits: max_num_seqs=1 + max_waiting=1
            stream = streams.enter_context(http.stream("POST", "/v1/completions", json=body))
            assert stream.status_code == 200
        refused = metrics(guarded.url, KEY).get("corelib_request_errors_total{status=429}", 0.0)
        error = error_of(http.post("/v1/completions", json={"prompt": [0, 5], "max_tokens": 2}), 429)
        assert error["type"] == "rate_limit_error" and "retry later" in str(error["message"])
        assert metrics(guarded.url, KEY)["corelib_request_errors_total{status=429}"] == refused + 1
    wait_idle(guarded.url, api_key=KEY)  # the two streams were closed by the client: aborted, blocks back
    with httpx.Client(base_url=guarded.url, headers=headers, timeout=30) as http:
        response = http.post("/v1/completions", json={"prompt": [0, 5], "max_tokens": 2})
        assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("override", "fragment"),
    [("server.port=70000", "server.port=70000: must be in [0, 65535]"),
     # each reads the plugin catalog in a fresh interpreter: one in the default run, the rest with the long checks
     pytest.param("server.max_waiting=-1", "server.max_waiting=-1: must be >= 0", marks=pytest.mark.long),
     pytest.param("server.log_level=loud", "server.log_level", marks=pytest.mark.long),
     pytest.param("server.bench.endpoint=chatty", "server.bench.endpoint", marks=pytest.mark.long)],
)
@pytest.mark.slow
def test_a_bad_server_setting_is_one_line_naming_the_key(
    override: str, fragment: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "backend=npu", override, f"hydra.run.dir={tmp_path}"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("corelib: error: ") and fragment in lines[0], lines
