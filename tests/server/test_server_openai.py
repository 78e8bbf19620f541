"""The server through the official openai client: the same text as the engine, streamed or not."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from corelib.engine.api import Engine
from corelib.engine.sequence import SamplingParams
from corelib.server.chat import ChatTemplate
from corelib.server.serve import RunningServer
from server.servekit import wait_idle

pytestmark = pytest.mark.slow


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def expected(reference: Engine, prompt: str | list[int], **sampling: object) -> str:
    [output] = reference.generate([prompt], SamplingParams(**sampling))  # type: ignore[arg-type]
    return output.text or ""


def test_completion_text_equals_the_engine_streamed_or_not(server: RunningServer, reference: Engine) -> None:
    want = expected(reference, "The quick brown", max_tokens=12, temperature=0.8, seed=7)
    assert want, "the reference produced no text; the comparison would prove nothing"
    api = client(server)
    whole = api.completions.create(model="chat-model", prompt="The quick brown", max_tokens=12, temperature=0.8,
                                   seed=7)
    assert whole.choices[0].text == want
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens == len(reference.encode("The quick brown"))
    stream = api.completions.create(model="chat-model", prompt="The quick brown", max_tokens=12, temperature=0.8,
                                    seed=7, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert len(pieces) > 1, "the text should arrive in pieces"
    assert "".join(pieces) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_penalties_reach_the_engine_through_the_client(server: RunningServer, reference: Engine) -> None:
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.8}
    want = expected(reference, "The quick brown", max_tokens=16, ignore_eos=True, **penalties)
    assert want != expected(reference, "The quick brown", max_tokens=16, ignore_eos=True), "penalties changed nothing"
    api = client(server)
    got = api.completions.create(model="chat-model", prompt="The quick brown", max_tokens=16, temperature=0,
                                 presence_penalty=1.5, frequency_penalty=0.5,
                                 extra_body={"ignore_eos": True, "repetition_penalty": 1.8})
    assert got.choices[0].text == want


def test_a_stop_string_ends_the_text_before_it(server: RunningServer, reference: Engine) -> None:
    free = expected(reference, "Hello world", max_tokens=24, ignore_eos=True)
    stop = next(free[i : i + 2] for i in range(len(free) // 3, len(free) - 2) if free[i : i + 2].strip())
    api = client(server)
    cut = api.completions.create(model="chat-model", prompt="Hello world", max_tokens=24, temperature=0,
                                 stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == free[: free.find(stop)]


def test_chat_renders_the_checkpoints_template(server: RunningServer, reference: Engine, model_dir: Path) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": "Be brief"},
                                                  {"role": "user", "content": "Hi"}]
    prompt_text = "<s>\n<|system|>Be brief</s>\n<|user|>Hi</s>\n<|assistant|>\n"  # trim_blocks, lstrip_blocks
    assert ChatTemplate.load(str(model_dir)).render([dict(m) for m in messages]) == prompt_text
    assert reference.tokenizer is not None
    prompt = reference.tokenizer.encode(prompt_text, add_special_tokens=False)
    assert prompt.count(0) == 1, "the template writes the BOS (<s>, id 0); encoding must not add another"
    want = expected(reference, prompt, max_tokens=10, temperature=0.5, seed=3)
    api = client(server)
    whole = api.chat.completions.create(model="chat-model", messages=messages, max_tokens=10,
                                        temperature=0.5, seed=3)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want
    assert whole.usage is not None and whole.usage.prompt_tokens == len(prompt)
    chunks = list(api.chat.completions.create(model="chat-model", messages=messages,
                                              max_tokens=10, temperature=0.5, seed=3, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_token_id_prompts_and_n_give_choices_in_order(server: RunningServer, reference: Engine) -> None:
    prompts = [[0, 5, 6, 7], [0, 9, 10]]
    whole = client(server).completions.create(model="chat-model", prompt=prompts, n=2, max_tokens=6, temperature=1.0,
                                              seed=11, extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    outputs = reference.generate([prompts[0], prompts[0], prompts[1], prompts[1]],
                                 [SamplingParams(max_tokens=6, temperature=1.0, seed=11 + i, ignore_eos=True)
                                  for i in range(4)])
    assert [c.text for c in whole.choices] == [o.text for o in outputs]
    assert whole.choices[0].text != whole.choices[1].text, "n choices of one prompt sample with different seeds"
    assert whole.usage is not None and whole.usage.prompt_tokens == 7 and whole.usage.completion_tokens == 24


def test_64_concurrent_streaming_clients_each_get_their_whole_text(server: RunningServer, reference: Engine) -> None:
    prompts = [f"{word} the lazy dog" for word in ("The", "A", "Hello", "world", "quick", "brown", "fox", "city")]
    want = {p: o.text for p, o in zip(prompts, reference.generate(prompts, SamplingParams(max_tokens=16,
                                                                                        ignore_eos=True)),
                                      strict=True)}

    async def one(api: openai.AsyncOpenAI, prompt: str) -> tuple[str, str, str | None]:
        stream = await api.completions.create(model="chat-model", prompt=prompt, max_tokens=16, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return prompt, text, reason

    async def all_clients() -> list[tuple[str, str, str | None]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as api:
            return await asyncio.gather(*(one(api, prompts[i % len(prompts)]) for i in range(64)))

    results = asyncio.run(all_clients())
    assert len(results) == 64
    assert all(reason == "length" for _, _, reason in results)
    assert all(text == want[prompt] for prompt, text, _ in results)
    wait_idle(server.url)


def test_models_and_health(server: RunningServer) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["chat-model"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


@pytest.mark.parametrize("wrong", ["gpt-4o", "tiny"])
def test_another_model_name_is_404_naming_it(server: RunningServer, wrong: str) -> None:
    with pytest.raises(openai.NotFoundError) as refused:
        client(server).completions.create(model=wrong, prompt="x", max_tokens=2)
    assert refused.value.code == "model_not_found" and wrong in refused.value.message
