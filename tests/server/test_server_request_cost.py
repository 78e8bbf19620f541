"""Through HTTP: a request is refused by what it costs before anything is built from it, and the server keeps serving.

The server runs on a thread of this process, so its routes see what a test patches here."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from corelib.config.schema import LogLevel, ServerConfig
from corelib.server import inputs
from corelib.server.events import EngineInfo
from corelib.server.fake import FakeSpec
from corelib.server.serve import RunningServer, start_in_thread
from corelib.server.served import EngineRecipe
from server.test_server_errors import error_of

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("prompts", "n"), [(65, 2), (50_000, 128)], ids=["one-beyond", "fifty-thousand-x-128"])
def test_prompts_times_n_are_refused_before_a_prompt_is_read(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch, prompts: int, n: int
) -> None:
    read: list[object] = []
    encode = inputs._encode

    def counted(prompt: str | list[int], info: EngineInfo) -> list[int]:
        read.append(prompt)
        return encode(prompt, info)

    monkeypatch.setattr(inputs, "_encode", counted)
    body = {"prompt": [[7]] * prompts, "n": n, "max_tokens": 1}
    error = error_of(httpx.post(f"{server.url}/v1/completions", json=body, timeout=120), 400)
    assert error["param"] == "n" and f"asks for {prompts * n} choices" in str(error["message"])
    assert "(engine.max_num_seqs + server.max_waiting)" in str(error["message"])
    assert not read, f"{len(read)} prompts were read before the request was refused"
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


@pytest.fixture(scope="module")
def tight() -> Iterator[RunningServer]:
    config = ServerConfig(port=0, log_level=LogLevel.warning, max_request_tokens=100)
    with start_in_thread(EngineRecipe(fake=FakeSpec()), config) as running:
        yield running


def test_prompt_tokens_beyond_server_max_request_tokens_are_a_400(tight: RunningServer) -> None:
    for prompt in ([5] * 101, [[5] * 51, [6] * 50]):
        error = error_of(httpx.post(f"{tight.url}/v1/completions", json={"prompt": prompt}, timeout=30), 400)
        assert error["param"] == "prompt" and "at most 100 per request (server.max_request_tokens)" in str(
            error["message"])
    fits = httpx.post(f"{tight.url}/v1/completions", json={"prompt": [5] * 100, "max_tokens": 2}, timeout=30)
    assert fits.status_code == 200, fits.text


def test_35000_content_parts_are_a_400_naming_the_cap(server: RunningServer) -> None:
    parts = [{"type": "text", "text": "a"}] * 35_000
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}]},
                          timeout=120)
    error = error_of(response, 400)
    assert error["param"] == "messages" and "35000 content parts" in str(error["message"])
    assert "at most 4096" in str(error["message"])
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
