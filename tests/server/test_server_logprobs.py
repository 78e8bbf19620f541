"""logprobs and top_logprobs through the official openai client: the engine's values, in OpenAI's shapes,
streamed or not, for completions and chat."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from corelib.engine.api import Engine
from corelib.engine.sequence import Logprob, SamplingParams
from corelib.server.serve import RunningServer

pytestmark = pytest.mark.slow


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def engine_logprobs(reference: Engine, prompt: str, k: int, max_tokens: int) -> list[tuple[str, float, list[str]]]:
    [out] = reference.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=k))
    tokenizer = reference.tokenizer
    assert out.logprobs is not None and tokenizer is not None

    def text(token: int) -> str:
        return tokenizer.decode([token])

    def top(token: int, entry: dict[int, Logprob]) -> list[str]:  # the sampled token is extra when outside the k
        return [text(t) for t, p in sorted(entry.items(), key=lambda item: item[1].rank or 0)
                if len(entry) == k or t != token]

    return [(text(token), entry[token].logprob, top(token, entry))
            for token, entry in zip(out.output_token_ids, out.logprobs, strict=True)]


def test_completion_logprobs_are_the_engines_streamed_or_not(server: RunningServer, reference: Engine) -> None:
    want = engine_logprobs(reference, "The quick brown", 3, 8)
    api = client(server)
    whole = api.completions.create(model="chat-model", prompt="The quick brown", max_tokens=8, temperature=0,
                                   logprobs=3, extra_body={"ignore_eos": True})
    scored = whole.choices[0].logprobs
    assert scored is not None and scored.tokens is not None and scored.token_logprobs is not None
    assert scored.tokens == [t for t, _, _ in want]
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(scored.token_logprobs, [p for _, p, _ in want],
                                                                  strict=True))
    # Keyed by token text, as OpenAI's legacy shape is: tokens of the same text (partial bytes) share a key.
    assert scored.top_logprobs is not None and [set(top) for top in scored.top_logprobs] == [set(t) for _, _, t in want]
    assert scored.text_offset == [sum(len(t) for t, _, _ in want[:i]) for i in range(len(want))]
    stream = api.completions.create(model="chat-model", prompt="The quick brown", max_tokens=8, temperature=0,
                                    logprobs=3, stream=True, extra_body={"ignore_eos": True})
    tokens, values, offsets = [], [], []
    for chunk in stream:
        piece = chunk.choices[0].logprobs
        if piece is not None and piece.tokens:
            tokens += piece.tokens
            values += piece.token_logprobs or []
            offsets += piece.text_offset or []
    assert tokens == scored.tokens and offsets == scored.text_offset
    assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(values, scored.token_logprobs, strict=True))


def test_chat_logprobs_and_top_logprobs_streamed_or_not(server: RunningServer) -> None:
    api = client(server)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]
    whole = api.chat.completions.create(model="chat-model", messages=messages, max_tokens=6, temperature=0,
                                        logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content if whole.choices[0].logprobs else None
    assert content is not None and len(content) == whole.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token, "greedy: the likeliest"
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    streamed = []
    for chunk in api.chat.completions.create(model="chat-model", messages=messages, max_tokens=6, temperature=0,
                                             logprobs=True, top_logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                              "top_logprobs": 30}, "top_logprobs"),
])
def test_logprobs_out_of_range_are_a_400_naming_the_field(server: RunningServer, path: str, body: dict[str, object],
                                                           param: str) -> None:
    response = httpx.post(f"{server.url}{path}", json={"model": "chat-model", **body}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_metrics_show_the_prefix_cache_finding_a_repeated_prompt(server: RunningServer) -> None:
    def figure(name: str) -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))

    before = figure("corelib_prefix_cache_hit_tokens")
    prompt = [(5 * i) % 200 + 3 for i in range(40)]  # two full blocks of 16 and a part
    for _ in range(2):
        client(server).completions.create(model="chat-model", prompt=prompt, max_tokens=2, temperature=0)
    assert figure("corelib_prefix_cache_hit_tokens") - before >= 32, "the second request found the first's blocks"
    assert 0 < figure("corelib_prefix_cache_hit_rate") <= 1
