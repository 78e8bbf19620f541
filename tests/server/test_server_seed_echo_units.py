"""The server's seed, echo and /tokenize helpers and its vLLM-named metrics, without a server."""

from __future__ import annotations

import json
import math
import random

import pytest

from corelib.engine.outputs import PromptLogprobs, RequestOutput
from corelib.engine.sequence import Logprob
from corelib.server.chat import ChatTemplate, check_template_kwargs
from corelib.server.events import EngineInfo
from corelib.server.inputs import RequestLimits, detokenize_ids, echo_texts, prepare_completion
from corelib.server.messages import Final
from corelib.server.metrics import ServerMetrics
from corelib.server.protocol import ApiError, CompletionRequest, DetokenizeRequest, parse_body
from corelib.server.responses import Formatter

INFO = EngineInfo(None, 64, 32, 8, "m", None)
LIMITS = RequestLimits(64, 1 << 20)


def completion(**body: object) -> CompletionRequest:
    return parse_body(json.dumps({"prompt": [1, 2, 3], "temperature": 1.0, **body}).encode(), CompletionRequest)


def seeds_of(request: CompletionRequest, seeds: random.Random | None) -> list[int | None]:
    return [sampling.seed for _, sampling in prepare_completion(request, INFO, LIMITS, seeds).requests]


def test_a_server_seed_makes_requests_without_one_repeatable_in_arrival_order() -> None:
    first = [seeds_of(completion(n=2), rng) for rng in [random.Random(0)] for _ in range(2)]
    again = [seeds_of(completion(n=2), rng) for rng in [random.Random(0)] for _ in range(2)]
    assert first == again and first[0] != first[1], "the same sequence of requests, the same seeds"
    assert all(seed is not None for seeds in first for seed in seeds)
    assert seeds_of(completion(n=2), None) == [None, None], "without server.seed each choice draws its own"
    assert seeds_of(completion(seed=7, n=2), random.Random(0)) == [7, 8], "a request's own seed wins"


def test_echo_texts_are_the_prompts_as_sent() -> None:
    request = completion(prompt=[[1, 2], [3]], echo=True, n=2)
    prepared = prepare_completion(request, INFO, LIMITS)
    assert echo_texts(request, prepared, INFO) == ["<1><2>", "<3>"]
    assert echo_texts(completion(), prepared, INFO) is None
    with pytest.raises(ApiError, match=r"^echo: with logprobs it shows the prompt's logprobs, which are not streamed"):
        prepare_completion(completion(echo=True, logprobs=1, stream=True), INFO, LIMITS)
    formatter = Formatter(False, "m", prepared, False, echo=echo_texts(request, prepared, INFO))
    assert [formatter.echoed(i) for i in range(4)] == ["<1><2>", "<1><2>", "<3>", "<3>"], "n choices per prompt"
    started = formatter.start(["a", "b", "c", "d"]).decode()
    assert [json.loads(line[6:])["choices"][0]["text"] for line in started.split("\n\n") if line] == [
        "<1><2>", "<1><2>", "<3>", "<3>"]
    output = RequestOutput("a", [1, 2], [9], "length", "")
    whole = formatter.response([Final(str(i), [9], "", output, None, False) for i in range(4)])
    choices = whole["choices"]
    assert isinstance(choices, list)
    assert [choice["text"] for choice in choices] == ["<1><2><9>", "<1><2><9>", "<3><9>", "<3><9>"]


def test_one_choice_per_prompt_computes_its_logprobs_and_every_choice_of_it_shows_them() -> None:
    request = completion(prompt=[[1, 2], [1, 2], [3, 4]], echo=True, logprobs=1, prompt_logprobs=0, n=2)
    prepared = prepare_completion(request, INFO, LIMITS)
    assert [sampling.prompt_logprobs for _, sampling in prepared.requests] == [1, None, None, None, 1, None]
    computed: dict[tuple[int, ...], PromptLogprobs] = {
        (1, 2): [None, {2: Logprob(-0.5, 2, None), 7: Logprob(-0.1, 1, None)}],
        (3, 4): [None, {4: Logprob(-math.inf, 9, None), 8: Logprob(-0.2, 1, None)}]}
    finals = []
    for i, (prompt, sampling) in enumerate(prepared.requests):
        output = RequestOutput(str(i), prompt, [9], "length", "", logprobs=[{9: Logprob(-0.3, 1, None)}],
                               prompt_logprobs=computed[tuple(prompt)] if sampling.prompt_logprobs else None)
        finals.append(Final(str(i), [9], "", output, None, False))
    formatter = Formatter(False, "m", prepared, False, echo=echo_texts(request, prepared, INFO))
    choices = formatter.response(finals)["choices"]
    assert isinstance(choices, list) and len(choices) == 6
    shown = [None, {"2": {"logprob": -0.5, "rank": 2, "decoded_token": "<2>"}}]
    assert [choice["prompt_logprobs"] for choice in choices[:4]] == [shown] * 4, "prompt_logprobs=0: the token alone"
    assert choices[1]["logprobs"] == choices[0]["logprobs"] == {
        "tokens": ["<1>", "<2>", "<9>"], "token_logprobs": [None, -0.5, -0.3],
        "top_logprobs": [None, {"<7>": -0.1}, {"<9>": -0.3}], "text_offset": [0, 3, 6]}
    assert choices[5]["logprobs"]["token_logprobs"][1] == -9999.0, "JSON has no -inf: vLLM's floor"
    json.dumps(choices, allow_nan=False)
    plain = prepare_completion(completion(), INFO, LIMITS)
    alone = Formatter(False, "m", plain, False).response(finals[:1])["choices"]
    assert plain.requests[0][1].prompt_logprobs is None, "not computed unless asked"
    assert isinstance(alone, list) and "prompt_logprobs" not in alone[0]


def test_detokenize_without_a_tokenizer_and_outside_the_vocabulary() -> None:
    assert detokenize_ids(DetokenizeRequest(tokens=[1, 2]), INFO, LIMITS) == "<1><2>"
    with pytest.raises(ApiError, match=r"^tokens: token id 64 is outside the vocabulary"):
        detokenize_ids(DetokenizeRequest(tokens=[64]), INFO, LIMITS)
    with pytest.raises(ApiError, match="per request"):
        detokenize_ids(DetokenizeRequest(tokens=[1, 2]), INFO, RequestLimits(64, 1))


def test_chat_template_kwargs_are_template_variables_but_messages() -> None:
    template = ChatTemplate("{% if enable_thinking is defined and not enable_thinking %}no-think {% endif %}"
                            "{{ messages[0]['content'] }}", "a test")
    assert template.render([{"role": "user", "content": "hi"}]) == "hi"
    assert template.render([{"role": "user", "content": "hi"}], kwargs={"enable_thinking": False}) == "no-think hi"
    with pytest.raises(ValueError, match=r"^chat_template_kwargs\.messages: the conversation is passed as messages"):
        check_template_kwargs({"messages": []})
    with pytest.raises(ValueError, match=r"^chat_template_kwargs\.a b: a template variable is named by an identifier"):
        check_template_kwargs({"a b": 1})


def test_vllm_names_follow_the_server_figures() -> None:
    metrics = ServerMetrics()
    metrics.name_model("m")
    metrics.set_gauges(waiting=2, running=3, kv_blocks_free=25, kv_blocks_total=100)
    metrics.finished(RequestOutput("a", [1, 2, 3], [4, 5], "stop", "", ttft_ms=20.0, tpot_ms=10.0))
    text = metrics.render().decode()
    for line in ('vllm:num_requests_waiting{model_name="m"} 2.0', 'vllm:num_requests_running{model_name="m"} 3.0',
                 'vllm:kv_cache_usage_perc{model_name="m"} 0.75', 'vllm:gpu_cache_usage_perc{model_name="m"} 0.75',
                 'vllm:prompt_tokens_total{model_name="m"} 3.0', 'vllm:generation_tokens_total{model_name="m"} 2.0',
                 'vllm:request_success_total{finished_reason="stop",model_name="m"} 1.0',
                 'vllm:e2e_request_latency_seconds_sum{model_name="m"} 0.03',
                 'vllm:inter_token_latency_seconds_count{model_name="m"} 1.0'):
        assert line in text, line
