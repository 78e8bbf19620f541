"""A checkpoint tokenizer that panics on some text (the tokenizers library raises a BaseException then) gives the
client an OpenAI error object, not the HTTP server's plain-text 500, and the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from corelib.config.schema import LogLevel, ServerConfig
from corelib.server.serve import RunningServer, start_in_thread
from server.servekit import write_chat_checkpoint
from server.test_server_errors import error_of

pytestmark = pytest.mark.slow

# A pre-tokenizer regex that backtracks: on a run of "a" that does not end the text, the regex engine gives up past
# its retry limit, and the tokenizers library panics.
BACKTRACKING = {"type": "Split", "pattern": {"Regex": "(a|a)+$"}, "behavior": "Isolated", "invert": False}
PANIC_TEXT = "a" * 40 + "b"


@pytest.fixture(scope="module")
def panicking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    directory = write_chat_checkpoint(tmp_path_factory.mktemp("panicking-tokenizer"))
    path = directory / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    tokenizer["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [BACKTRACKING, tokenizer["pre_tokenizer"]]}
    path.write_text(json.dumps(tokenizer))
    config = ServerConfig(port=0, log_level=LogLevel.warning, served_model_name="m")
    with start_in_thread(["backend=npu", f"model.path={directory}"], config) as running:
        yield running


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [("/v1/completions", {"prompt": PANIC_TEXT, "max_tokens": 2}, "prompt"),
     ("/v1/chat/completions", {"messages": [{"role": "user", "content": PANIC_TEXT}], "max_tokens": 2}, "messages")],
    ids=["completions", "chat"],
)
def test_a_tokenizer_panic_is_an_openai_error_and_the_server_keeps_serving(
    panicking: RunningServer, path: str, body: dict[str, object], param: str
) -> None:
    error = error_of(httpx.post(f"{panicking.url}{path}", json=body, timeout=60), 400)
    message = str(error["message"])
    assert error["param"] == param and "tokenizer failed on the text" in message and "retry-limit" in message
    fine = httpx.post(f"{panicking.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert fine.status_code == 200, fine.text
