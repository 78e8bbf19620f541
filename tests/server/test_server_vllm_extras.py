"""What a vLLM client sends beyond the OpenAI routes: /tokenize, /detokenize, /version, /ping, echo,
chat_template_kwargs, min_tokens, and the metrics under vLLM's names."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from corelib import __version__
from corelib.config.schema import LogLevel, ServerConfig
from corelib.engine.api import Engine
from corelib.sampling_params import SamplingParams
from corelib.server.chat import ChatTemplate
from corelib.server.fake import FakeSpec
from corelib.server.serve import RunningServer, start_in_thread
from corelib.server.served import EngineRecipe
from server.servekit import data_lines, metrics, wait_idle

pytestmark = pytest.mark.slow

KEY = "extras-key"
CONVERSATION = [{"role": "user", "content": "Hello world"}]
# The server's float32 logprobs against the reference engine's: two engines of one model, whose sums need not agree
# to the last bits (seen once, on a loaded 2-core machine: -6.462254 against -6.462303, ranks and tokens equal; the
# cause was not pinned down). test_server_logprobs.py holds them to the same bound.
LOGPROB_TOL = 1e-4


def post(server: RunningServer, path: str, body: dict[str, object], key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def test_tokenize_a_prompt_as_completions_would(server: RunningServer, reference: Engine) -> None:
    got = post(server, "/tokenize", {"model": "chat-model", "prompt": "The quick brown fox"}).json()
    ids = reference.encode("The quick brown fox")
    assert got == {"count": len(ids), "max_model_len": reference.startup.config.model.max_model_len, "tokens": ids}
    strs = post(server, "/tokenize", {"prompt": "The quick", "return_token_strs": True}).json()
    tokenizer = reference.tokenizer
    assert tokenizer is not None
    assert strs["token_strs"] == [tokenizer.decode([token]) for token in strs["tokens"]]


def test_tokenize_messages_as_chat_renders_them(server: RunningServer, model_dir: Path, reference: Engine) -> None:
    template = ChatTemplate.load(str(model_dir))
    tokenizer = reference.tokenizer
    assert tokenizer is not None
    text = template.render(CONVERSATION)
    got = post(server, "/tokenize", {"messages": CONVERSATION}).json()
    assert got["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    bare = post(server, "/tokenize", {"messages": CONVERSATION, "add_generation_prompt": False}).json()
    assert bare["tokens"] == tokenizer.encode(template.render(CONVERSATION, kwargs={"add_generation_prompt": False}),
                                              add_special_tokens=False)
    assert bare["count"] < got["count"], "without the generation prompt the conversation is shorter"
    both = post(server, "/tokenize", {"prompt": "x", "messages": CONVERSATION})
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"


def test_detokenize_gives_back_the_text(server: RunningServer, reference: Engine) -> None:
    ids = reference.encode("Hello world, the engine says hello back.")
    assert post(server, "/detokenize", {"tokens": ids}).json() == {
        "prompt": reference.tokenizer.decode_special(ids)}  # type: ignore[union-attr]
    refused = post(server, "/detokenize", {"tokens": [10**9]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"


def test_version_and_ping(server: RunningServer) -> None:
    assert httpx.get(f"{server.url}/version", timeout=30).json() == {"version": __version__}
    assert httpx.get(f"{server.url}/ping", timeout=30).status_code == 200
    assert httpx.post(f"{server.url}/ping", timeout=30).status_code == 200


def test_echo_puts_the_prompt_before_the_text_whole_and_streamed(server: RunningServer, reference: Engine) -> None:
    body = {"prompt": "The quick brown", "max_tokens": 6, "temperature": 0, "echo": True}
    [output] = reference.generate(["The quick brown"], SamplingParams(max_tokens=6))
    whole = post(server, "/v1/completions", body).json()
    assert whole["choices"][0]["text"] == "The quick brown" + (output.text or "")
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        lines = data_lines(response.iter_lines())
    texts = [json.loads(line)["choices"][0]["text"] for line in lines if line != "[DONE]"]
    assert texts[0] == "The quick brown" and "".join(texts) == whole["choices"][0]["text"]
    ids = post(server, "/v1/completions", {**body, "prompt": reference.encode("The quick brown")}).json()
    assert ids["choices"][0]["text"].endswith(output.text or "")


def test_prompt_logprobs_are_the_engines_per_prompt_token(server: RunningServer, reference: Engine) -> None:
    prompt = "The quick brown fox jumps"
    [expected] = reference.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2))
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    [choice] = post(server, "/v1/completions", body).json()["choices"]
    shown, wanted = choice["prompt_logprobs"], expected.prompt_logprobs
    assert wanted is not None and len(shown) == len(wanted) == len(expected.prompt_token_ids) > 2
    assert shown[0] is None and wanted[0] is None
    for entry, want in zip(shown[1:], wanted[1:], strict=True):
        assert want is not None and list(entry) == [str(token) for token in want], "the prompt token, then by rank"
        for token, logprob in want.items():
            assert entry[str(token)]["rank"] == logprob.rank
            assert entry[str(token)]["decoded_token"] == logprob.decoded_token
            assert math.isclose(entry[str(token)]["logprob"], logprob.logprob, abs_tol=LOGPROB_TOL)
    chat = post(server, "/v1/chat/completions", {"messages": CONVERSATION, "max_tokens": 1, "prompt_logprobs": 0})
    assert len(chat.json()["prompt_logprobs"]) == chat.json()["usage"]["prompt_tokens"], "chat: beside the choices"


def test_echo_with_logprobs_gives_the_prompts_tokens_then_the_output(server: RunningServer,
                                                                     reference: Engine) -> None:
    prompt = "The quick brown"
    [expected] = reference.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1,
                                                             prompt_logprobs=1))
    body = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0, "echo": True, "logprobs": 1}
    [choice] = post(server, "/v1/completions", body).json()["choices"]
    logprobs, text = choice["logprobs"], choice["text"]
    assert text == prompt + (expected.text or "")
    ids = [*expected.prompt_token_ids, *expected.output_token_ids]
    tokenizer = reference.tokenizer
    assert tokenizer is not None and logprobs["tokens"] == [tokenizer.decode([token]) for token in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert expected.prompt_logprobs is not None and expected.logprobs is not None
    entries = [*expected.prompt_logprobs[1:], *expected.logprobs]
    for got, token, entry in zip(logprobs["token_logprobs"][1:], ids[1:], entries, strict=True):
        assert entry is not None and math.isclose(got, entry[token].logprob, abs_tol=LOGPROB_TOL)
    assert all(len(top) == 1 for top in logprobs["top_logprobs"][1:])
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets[len(expected.prompt_token_ids)] == len(prompt), "the output after the echo"
    for token, offset in zip(logprobs["tokens"], offsets, strict=True):
        assert text[offset : offset + len(token)] == token


def test_chat_template_kwargs_reach_the_template(server: RunningServer) -> None:
    body: dict[str, object] = {"messages": CONVERSATION, "max_tokens": 2}
    plain = post(server, "/v1/chat/completions", body).json()
    bare = post(server, "/v1/chat/completions",
                {**body, "chat_template_kwargs": {"add_generation_prompt": False}}).json()
    assert bare["usage"]["prompt_tokens"] < plain["usage"]["prompt_tokens"]
    refused = post(server, "/v1/chat/completions", {**body, "chat_template_kwargs": {"messages": []}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"
    assert "chat_template_kwargs.messages" in refused.json()["error"]["message"]


def test_min_tokens_holds_back_the_stop_tokens(server: RunningServer, reference: Engine) -> None:
    [free] = reference.generate(["The quick brown"], SamplingParams(max_tokens=8, ignore_eos=True))
    first = free.output_token_ids[0]
    body = {"prompt": "The quick brown", "max_tokens": 8, "temperature": 0, "stop_token_ids": [first]}
    stopped = post(server, "/v1/completions", body).json()
    assert stopped["usage"]["completion_tokens"] == 1
    held = post(server, "/v1/completions", {**body, "min_tokens": 4}).json()
    assert held["usage"]["completion_tokens"] >= 4


def test_logit_bias_with_json_string_keys_moves_the_token(server: RunningServer, reference: Engine) -> None:
    [free] = reference.generate(["The quick brown"], SamplingParams(max_tokens=3, ignore_eos=True))
    favourite = (free.output_token_ids[0] + 7) % reference.vocab_size
    body = {"prompt": "The quick brown", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = post(server, "/v1/completions", body).json()
    biased = post(server, "/v1/completions", {**body, "logit_bias": {str(favourite): 100}}).json()
    assert plain["choices"][0]["text"] != biased["choices"][0]["text"]
    bad = post(server, "/v1/completions", {**body, "logit_bias": {"-1": 5}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def test_metrics_under_vllm_names(server: RunningServer) -> None:
    before = wait_idle(server.url)
    post(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}).raise_for_status()
    after = wait_idle(server.url)
    label = "model_name=chat-model"
    assert after[f"vllm:num_requests_running{{{label}}}"] == 0
    assert after[f"vllm:num_requests_waiting{{{label}}}"] == 0
    assert after[f"vllm:kv_cache_usage_perc{{{label}}}"] == after[f"vllm:gpu_cache_usage_perc{{{label}}}"] == 0
    assert after[f"vllm:prompt_tokens_total{{{label}}}"] - before[f"vllm:prompt_tokens_total{{{label}}}"] == 3
    assert after[f"vllm:generation_tokens_total{{{label}}}"] - before[f"vllm:generation_tokens_total{{{label}}}"] == 3
    success = f"vllm:request_success_total{{finished_reason=length,{label}}}"
    assert after[success] - before.get(success, 0) == 1
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                      "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        name = f"vllm:{histogram}_count{{{label}}}"
        assert after[name] - before[name] == 1, histogram


@pytest.fixture(scope="module")
def keyed() -> Iterator[RunningServer]:
    config = ServerConfig(port=0, log_level=LogLevel.warning)
    with start_in_thread(EngineRecipe(fake=FakeSpec()), config, api_key=KEY, placement="thread") as running:
        yield running


def test_tokenize_and_detokenize_need_the_key_version_and_ping_do_not(keyed: RunningServer) -> None:
    bodies: list[tuple[str, dict[str, object]]] = [("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})]
    for path, body in bodies:
        assert post(keyed, path, body).status_code == 401
    assert post(keyed, "/detokenize", {"tokens": [1, 2]}, KEY).json() == {"prompt": "<1><2>"}
    without = post(keyed, "/tokenize", {"prompt": "x"}, KEY)
    assert without.status_code == 400 and "no tokenizer" in without.json()["error"]["message"]
    assert httpx.get(f"{keyed.url}/version", timeout=30).status_code == 200
    assert httpx.get(f"{keyed.url}/ping", timeout=30).status_code == 200
    assert "vllm:num_requests_running{model_name=fake}" in metrics(keyed.url, KEY)
