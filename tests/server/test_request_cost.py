"""What a request may cost is checked from the body as sent, before anything is built from it: its choices (prompts x
n) and its prompt tokens. A body of a few hundred kilobytes must not make the server build millions of choices only
to refuse them afterwards."""

from __future__ import annotations

import json

import pytest

from corelib import sampling_params
from corelib.sampling_params import SamplingParams
from corelib.server import inputs
from corelib.server.events import EngineInfo
from corelib.server.inputs import RequestLimits, check_choices, prepare_completion
from corelib.server.protocol import ApiError, ChatRequest, CompletionRequest, parse_body

INFO = EngineInfo(tokenizer=None, vocab_size=512, max_model_len=64, max_num_seqs=64, model_name="m", model_path=None)
LIMITS = RequestLimits(max_choices=128, max_prompt_tokens=1000)


class Built:
    """Counts what prepare_completion builds: prompts read and choices made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.prompts = 0
        self.choices = 0
        encode = inputs._encode

        def counted_encode(prompt: str | list[int], info: EngineInfo) -> list[int]:
            self.prompts += 1
            return encode(prompt, info)

        def counted_choices(params: SamplingParams, first: int = 0) -> list[SamplingParams]:
            made = sampling_params.choices(params, first)
            self.choices += len(made)
            return made

        monkeypatch.setattr(inputs, "_encode", counted_encode)
        monkeypatch.setattr(inputs, "choices", counted_choices)


def completion(body: dict[str, object]) -> CompletionRequest:
    return parse_body(json.dumps(body).encode(), CompletionRequest)


def refusal(body: dict[str, object], limits: RequestLimits = LIMITS) -> ApiError:
    with pytest.raises(ApiError) as refused:
        prepare_completion(completion(body), INFO, limits)
    error = refused.value
    assert error.status == 400 and "\n" not in error.message
    assert error.body() == {"error": {"message": error.message, "type": "invalid_request_error", "param": error.param,
                                      "code": None}}
    return error


@pytest.mark.parametrize(
    ("prompts", "n"),
    [
        pytest.param(50_000, 128, id="fifty-thousand-prompts-n128"),
        pytest.param(65, 2, id="one-beyond"),
        pytest.param(200, 1, id="prompts-alone"),
    ],
)
def test_prompts_times_n_beyond_what_the_server_holds_is_refused_before_any_prompt_is_read(
    monkeypatch: pytest.MonkeyPatch, prompts: int, n: int
) -> None:
    built = Built(monkeypatch)
    error = refusal({"prompt": [[7]] * prompts, "n": n})
    assert error.param == "n"
    assert f"asks for {prompts * n} choices" in error.message
    assert "at most 128 requests at once (engine.max_num_seqs + server.max_waiting)" in error.message
    assert (built.prompts, built.choices) == (0, 0), "the request was built before it was refused"


def test_text_prompts_are_counted_before_they_are_tokenized(monkeypatch: pytest.MonkeyPatch) -> None:
    built = Built(monkeypatch)
    error = refusal({"prompt": ["x"] * 100, "n": 2})  # a model without a tokenizer: reading one would be a 400 too
    assert error.param == "n" and "asks for 200 choices" in error.message
    assert built.prompts == 0


def test_n_beyond_the_per_prompt_cap_is_refused_before_any_prompt_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    built = Built(monkeypatch)
    error = refusal({"prompt": [[7]] * 10, "n": 129})
    assert error.param == "n" and "at most 128 choices per prompt" in error.message
    assert built.prompts == 0


@pytest.mark.parametrize(
    "prompt",
    [pytest.param([5] * 1001, id="one-prompt"), pytest.param([[5] * 40] * 26, id="several-prompts")],
)
def test_prompt_token_ids_beyond_the_limit_are_refused_before_any_is_read(
    monkeypatch: pytest.MonkeyPatch, prompt: list[object]
) -> None:
    built = Built(monkeypatch)
    error = refusal({"prompt": prompt})
    assert error.param == "prompt"
    assert "at most 1000 per request (server.max_request_tokens)" in error.message
    assert (built.prompts, built.choices) == (0, 0)


def test_a_request_within_its_limits_is_built_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    built = Built(monkeypatch)
    prepared = prepare_completion(completion({"prompt": [[5] * 10] * 64, "n": 2}), INFO, LIMITS)
    assert len(prepared.requests) == 128 and prepared.num_prompt_tokens == 640
    assert (built.prompts, built.choices) == (64, 128)


@pytest.mark.parametrize(("n", "fragment"), [(3, "asks for 3 choices"), (200, "at most 128 choices per prompt")])
def test_a_chat_request_is_checked_the_same_way(n: int, fragment: str) -> None:
    chat = parse_body(json.dumps({"messages": [{"role": "user", "content": "x"}], "n": n}).encode(), ChatRequest)
    with pytest.raises(ApiError) as refused:
        check_choices(chat, 1, RequestLimits(max_choices=2, max_prompt_tokens=1000))
    assert refused.value.param == "n" and fragment in refused.value.message


@pytest.mark.parametrize("n", ["2", 2.0, True, 0, -1])
def test_an_n_that_is_not_a_positive_integer_is_left_to_sampling_params_to_name(n: object) -> None:
    error = refusal({"prompt": [[7]] * 200, "n": n})
    assert error.param == "n" and "choices" not in error.message



@pytest.mark.parametrize("body", [{"max_tokens": 8}, {"max_tokens": 8, "seed": 3, "logprobs": 2}],
                         ids=["plain", "seed-and-logprobs"])
def test_a_single_choice_checks_its_sampling_parameters_twice_not_once_per_field_it_sets(
    monkeypatch: pytest.MonkeyPatch, body: dict[str, object]
) -> None:
    """Every SamplingParams checks all its fields (tens of microseconds); the event loop prepares a short request
    of token ids, so each one built is time to first token: the body's values once, then its max_tokens."""
    built: list[SamplingParams] = []
    check = SamplingParams.__post_init__

    def counted(params: SamplingParams) -> None:
        built.append(params)
        check(params)

    monkeypatch.setattr(SamplingParams, "__post_init__", counted)
    prepared = prepare_completion(completion({"prompt": [5] * 40, **body}), INFO, LIMITS)
    [(_, params)] = prepared.requests
    assert (params.n, params.max_tokens, params.seed, params.logprobs) == (1, 8, body.get("seed"), body.get("logprobs"))
    assert len(built) == 2, f"{len(built)} SamplingParams built for one choice"
