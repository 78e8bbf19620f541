"""LLM.chat renders a checkpoint's chat template as the server does: in a worker process with a time and memory
budget, probed first. A hostile template is one clear error within the budget, and the caller's process never
compiles it (this test process refuses to: a compile here fails the test at once instead of hanging it)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import jinja2
import pytest

from corelib import LLM, SamplingParams
from corelib.errors import ConfigError
from corelib.models.synthetic import write_text_checkpoint
from corelib.server.chat import ChatTemplate, ChatTemplateError
from corelib.server.render import RENDER_TIMEOUT_S
from server.test_template_budget import AT_COMPILE, HOSTILE, TRIGGER

pytestmark = pytest.mark.slow

ONE = [{"role": "user", "content": "Hi"}]
TWO = [*ONE, {"role": "user", "content": "again"}]
SLACK_S = 120.0  # a worker's start and a kill on a busy machine; a template that loops never ends at all


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    checkpoint = write_text_checkpoint(tmp_path_factory.mktemp("text-model"))
    with LLM(model=str(checkpoint), backend="npu", max_num_seqs=4) as built:
        yield built


@pytest.fixture(autouse=True)
def never_compiled_here(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: ChatTemplate) -> jinja2.Template:
        raise AssertionError(f"the chat template from {self.origin} was compiled in the caller's process")

    monkeypatch.setattr(ChatTemplate, "compiled", refuse)


def template_file(directory: Path, name: str, source: str) -> str:
    path = directory / f"{name}.jinja"
    path.write_text(source)
    return str(path)


def test_a_looping_template_is_a_template_error_within_its_budget(llm: LLM, tmp_path: Path) -> None:
    looping = template_file(tmp_path, "loop", TRIGGER.replace("HOSTILE", HOSTILE["nested-ranges"]))
    params = SamplingParams(max_tokens=2)
    started = time.monotonic()
    with pytest.raises(ChatTemplateError) as refused:
        llm.chat(TWO, params, use_tqdm=False, chat_template=looping)
    assert time.monotonic() - started < RENDER_TIMEOUT_S + SLACK_S
    message = str(refused.value)
    assert "\n" not in message and f"from chat_template={looping}" in message and "did not render within" in message
    [answer] = llm.chat(ONE, params, use_tqdm=False, chat_template=looping)  # the renderer recovered
    assert answer.prompt == "Hi"


@pytest.mark.parametrize("name", list(AT_COMPILE))
def test_a_template_that_explodes_as_it_compiles_is_refused_and_never_compiled_here(
    llm: LLM, tmp_path: Path, name: str
) -> None:
    exploding = template_file(tmp_path, name, TRIGGER.replace("HOSTILE", AT_COMPILE[name]))
    with pytest.raises(ConfigError) as refused:
        llm.chat(ONE, SamplingParams(max_tokens=2), use_tqdm=False, chat_template=exploding)
    message = str(refused.value)
    assert "\n" not in message and "cannot be compiled: MemoryError" in message
    assert f"chat_template={exploding}" in message and "pass another with chat_template=FILE" in message


def test_a_template_that_fails_the_probe_is_refused_before_any_conversation(llm: LLM, tmp_path: Path) -> None:
    failing = template_file(tmp_path, "probe", "{{ raise_exception('never') }}")
    with pytest.raises(ConfigError, match=r"fails on a one-message conversation .*never"):
        llm.chat(TWO, SamplingParams(max_tokens=2), use_tqdm=False, chat_template=failing)


def test_the_checkpoint_template_still_renders_and_its_worker_is_kept(llm: LLM) -> None:
    [first] = llm.chat(ONE, SamplingParams(max_tokens=2), use_tqdm=False)
    renderer = llm._renderer
    [second] = llm.chat(TWO, SamplingParams(max_tokens=2), use_tqdm=False)
    assert first.prompt == "<|user|>Hi\n<|assistant|>"
    assert second.prompt == "<|user|>Hi\n<|user|>again\n<|assistant|>"
    assert llm._renderer is renderer, "the same template started a second renderer"
