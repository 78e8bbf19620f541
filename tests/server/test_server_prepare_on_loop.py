"""A short completion of token ids is prepared on the event loop; text (a tokenizer's work) in a worker thread.

A hop to a worker thread and back waits for the GIL while the loop streams or parses a burst of requests:
milliseconds of time to first token that a pass over a few thousand ids at C speed does not cost.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from corelib.config.schema import LogLevel, ServerConfig
from corelib.server import app
from corelib.server.events import EngineInfo
from corelib.server.fake import FakeSpec
from corelib.server.inputs import (
    ON_LOOP_CHOICES,
    ON_LOOP_TOKENS,
    Prepared,
    RequestLimits,
    prepare_completion,
    prepares_on_loop,
)
from corelib.server.protocol import CompletionRequest, parse_body
from corelib.server.serve import RunningServer, start_in_thread
from corelib.server.served import EngineRecipe

INFO = EngineInfo(tokenizer=None, vocab_size=100, max_model_len=1 << 14, max_num_seqs=8, model_name="m",
                  model_path=None)


def completion(body: str) -> CompletionRequest:
    return parse_body(body.encode(), CompletionRequest)


def test_token_ids_are_prepared_on_the_loop_text_grammars_and_many_ids_or_choices_are_not() -> None:
    assert prepares_on_loop(completion('{"prompt": [5, 6, 7]}'))
    assert prepares_on_loop(completion('{"prompt": [[5, 6], [7]], "n": 2}'))
    assert prepares_on_loop(completion(f'{{"prompt": {[5] * ON_LOOP_TOKENS}}}'))
    assert not prepares_on_loop(completion(f'{{"prompt": {[5] * (ON_LOOP_TOKENS + 1)}}}'))
    assert not prepares_on_loop(completion(f'{{"prompt": [5], "n": {ON_LOOP_CHOICES + 1}}}'))
    assert not prepares_on_loop(completion(f'{{"prompt": {[[5]] * (ON_LOOP_CHOICES + 1)}}}'))
    assert not prepares_on_loop(completion('{"prompt": "some text"}'))
    assert not prepares_on_loop(completion('{"prompt": ["some", "texts"]}'))
    assert not prepares_on_loop(completion('{"prompt": [5], "n": "2"}')), "an n it cannot read: off the loop"
    assert not prepares_on_loop(completion('{"prompt": [5], "response_format": {"type": "json_object"}}'))


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    config = ServerConfig(port=0, log_level=LogLevel.warning)
    with start_in_thread(EngineRecipe(fake=FakeSpec(step_ms=0.5)), config, placement="thread") as running:
        yield running


@pytest.mark.slow
def test_a_streamed_completion_of_token_ids_is_prepared_on_the_event_loop(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    def watched(request: CompletionRequest, info: EngineInfo, limits: RequestLimits, *rest: object) -> Prepared:
        threads.append(threading.current_thread().name)
        return prepare_completion(request, info, limits, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(app, "prepare_completion", watched)
    body = {"prompt": [5] * 1056, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert b"[DONE]" in response.read()
    text = httpx.post(f"{server.url}/v1/completions", json={"prompt": "text", "max_tokens": 3}, timeout=60)
    assert text.status_code == 400, "the stand-in has no tokenizer"
    assert threads[0] == "corelib-http", f"token ids were prepared on {threads[0]!r}, not the event loop's thread"
    assert threads[1] != "corelib-http", "text is tokenized off the event loop"
