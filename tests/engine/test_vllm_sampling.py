"""vLLM's sampling options and output fields: min_p, logit_bias and min_tokens on the device (against the
independent sampler of tests/samplerkit.py), stop_reason, cumulative_logprob, include_stop_str_in_output,
detokenize, max_tokens=None, and the refusals of values the device cannot hold."""

from __future__ import annotations

import math

import pytest
import torch
from samplerkit import Sampling
from samplerkit import sample as kit_sample
from support import EngineFactory, reference_sampled, seeded_weights

from corelib import LLM
from corelib.engine.requests import cut_at_stop
from corelib.engine.sequence import FinishReason, Sequence
from corelib.engine.stops import StopChecker
from corelib.ops import SAMPLING_TABLES, SamplingInputs
from corelib.ops.sampling import sample_rows
from corelib.sampling_params import LOGIT_BIAS_WIDTH, SamplingError, SamplingParams

VOCAB = 64
EOS = 1
PROMPT = [(5 * i) % 300 + 2 for i in range(11)]
WIDTH = {t.name: t.width for t in SAMPLING_TABLES}


# ---------------------------------------------------------------------------------- the sampler
def _inputs(settings: list[Sampling], outputs: list[int], prompt_len: int) -> SamplingInputs:
    rows = len(settings)
    bias_ids = torch.zeros((rows, WIDTH["bias_ids"]), dtype=torch.int64)
    bias_values = torch.zeros((rows, WIDTH["bias_values"]), dtype=torch.float32)
    stop_ids = torch.full((rows, WIDTH["stop_ids"]), -1, dtype=torch.int64)
    for row, s in enumerate(settings):
        for i, (token, bias) in enumerate(s.logit_bias):
            bias_ids[row, i], bias_values[row, i] = token, bias
        if s.min_tokens:
            stop_ids[row, : len(s.stop_ids)] = torch.tensor(s.stop_ids)
    positions = torch.tensor([prompt_len + n for n in outputs])
    return SamplingInputs.of(
        positions, None, torch.full((rows,), prompt_len), temperature=[s.temperature for s in settings],
        top_k=[s.top_k for s in settings], top_p=[s.top_p for s in settings], min_p=[s.min_p for s in settings],
        min_tokens=[s.min_tokens for s in settings], seeds=[s.seed or 0 for s in settings],
        bias_ids=bias_ids, bias_values=bias_values, stop_ids=stop_ids)


@pytest.mark.parametrize("trial", range(6))
def test_min_p_logit_bias_and_min_tokens_sample_what_the_kit_samples(trial: int) -> None:
    gen = torch.Generator().manual_seed(trial)
    chance = int(torch.randint(0, 1 << 30, (1,), generator=gen))
    settings, outputs = [], []
    for row in range(12):
        sampled = row % 3 != 0
        stops = tuple(int(t) for t in torch.randperm(VOCAB, generator=gen)[: 1 + row % 4])
        bias = tuple((int(t), float(b)) for t, b in zip(torch.randperm(VOCAB, generator=gen)[: row % 5],
                                                         (-100.0, 3.0, -2.0, 100.0), strict=False))
        settings.append(Sampling(temperature=(0.7, 1.3)[row % 2] if sampled else 0.0, seed=chance + row,
                                 top_k=(0, 5)[row % 2], top_p=(1.0, 0.9)[row % 2], min_p=(0.0, 0.1, 0.4)[row % 3],
                                 min_tokens=row % 4, logit_bias=bias, stop_ids=stops))
        outputs.append(row % 5)  # so far: below min_tokens on some rows, past it on others
    logits = torch.randn((len(settings), VOCAB), generator=gen) * 3
    prompt = list(range(7))
    got = sample_rows(logits, _inputs(settings, outputs, len(prompt))).tolist()
    want = [kit_sample(logits[row], prompt, [0] * outputs[row], s) for row, s in enumerate(settings)]
    assert got == want
    for token, s, made in zip(got, settings, outputs, strict=True):
        if made < s.min_tokens:
            assert token not in s.stop_ids, "a stop id is banned before min_tokens"


def test_each_option_changes_what_is_sampled() -> None:
    """Each option on its own moves the token off the plain argmax (or the plain draw), so none goes unread."""
    logits = torch.tensor([[4.0, 3.9, 0.0, -1.0, 2.0, 0.5]])
    plain = Sampling()
    assert _one(logits, plain) == 0
    assert _one(logits, Sampling(logit_bias=((3, 10.0),))) == 3
    assert _one(logits, Sampling(logit_bias=((0, -100.0),))) == 1
    assert _one(logits, Sampling(min_tokens=2, stop_ids=(0, 1)), made=1) == 4
    assert _one(logits, Sampling(min_tokens=2, stop_ids=(0, 1)), made=2) == 0, "past min_tokens: no ban"
    # min_p: p(token 4) / p(token 0) = exp(-2): a min_p above that cuts it, whatever the noise draws.
    draws = {_one(logits, Sampling(temperature=1.0, seed=seed, min_p=0.2)) for seed in range(200)}
    assert draws == {0, 1}, draws
    assert len({_one(logits, Sampling(temperature=1.0, seed=seed)) for seed in range(200)}) > 2


def _one(logits: torch.Tensor, s: Sampling, made: int = 0) -> int:
    token = int(sample_rows(logits, _inputs([s], [made], 3))[0])
    assert token == kit_sample(logits[0], [5, 5, 5], [2] * made, s)
    return token


# ---------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("values", "field", "fragment"), [
    ({"min_p": 1.5}, "min_p", "must be in [0, 1]"),
    ({"min_tokens": -1}, "min_tokens", "must be >= 0"),
    ({"min_tokens": 5, "max_tokens": 3}, "min_tokens", "at most max_tokens=3"),
    ({"logit_bias": {3: 100.5}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias", "not a token id"),
    ({"logit_bias": [1, 2]}, "logit_bias", "mapping of token id to bias"),
    ({"logit_bias": {i: 1.0 for i in range(LOGIT_BIAS_WIDTH + 1)}}, "logit_bias", f"at most {LOGIT_BIAS_WIDTH}"),
    ({"stop": ["x"], "detokenize": False}, "stop", "detokenize=False"),
    ({"max_tokens": 0}, "max_tokens", "None: to the end of the context"),
    ({"min_tokens": 1, "stop_token_ids": list(range(30))}, "stop_token_ids", "with min_tokens"),
])
def test_bad_values_are_refused_in_one_line_naming_the_field(values: dict[str, object], field: str,
                                                            fragment: str) -> None:
    with pytest.raises(SamplingError) as refused:
        SamplingParams(**values)  # type: ignore[arg-type]
    assert refused.value.field == field and fragment in str(refused.value) and "\n" not in str(refused.value)


def test_logit_bias_takes_json_keys_and_is_checked_against_the_vocabulary() -> None:
    params = SamplingParams.from_mapping({"logit_bias": {"7": -100, "12": 2.5}, "min_p": 0.1})
    assert params.logit_bias == {7: -100.0, 12: 2.5} and params.needs_sampler
    assert SamplingParams(logit_bias={}).needs_sampler is False
    with pytest.raises(SamplingError, match=r"^logit_bias: token id 70 is outside the vocabulary \[0, 64\)$"):
        SamplingParams(logit_bias={70: 1.0}).validate(VOCAB)


# ---------------------------------------------------------------------------------- stops on the host
def _stopped(params: SamplingParams, tokens: list[int], eos: frozenset[int] = frozenset({EOS})) -> Sequence:
    checker = StopChecker(100, eos)
    seq = Sequence(0, "r", [5, 6, 7], params)
    for token in tokens:
        seq.output_token_ids.append(token)
        reason = checker.stop_reason(seq, token)
        if reason is not None:
            seq.finish_reason = reason
            break
    return seq


def test_stop_reason_is_the_stop_id_or_string_and_none_at_eos_or_length() -> None:
    by_id = _stopped(SamplingParams(max_tokens=9, stop_token_ids=[8]), [4, 8, 9])
    assert (by_id.finish_reason, by_id.stop_reason, by_id.output_token_ids) == (FinishReason.stop, 8, [4, 8])
    at_eos = _stopped(SamplingParams(max_tokens=9), [4, EOS])
    assert (at_eos.finish_reason, at_eos.stop_reason) == (FinishReason.stop, None)
    at_length = _stopped(SamplingParams(max_tokens=2, stop=["zz"]), [4, 5, 6])
    assert (at_length.finish_reason, at_length.stop_reason) == (FinishReason.length, None)
    by_text = _stopped(SamplingParams(max_tokens=9, stop=["<5><6>"]), [4, 5, 6, 7])  # the text of id t is <t>
    assert (by_text.finish_reason, by_text.stop_reason) == (FinishReason.stop, "<5><6>")
    assert cut_at_stop(by_text.text, by_text) == "<4>"
    kept = _stopped(SamplingParams(max_tokens=9, stop=["<5><6>"], include_stop_str_in_output=True), [4, 5, 6, 7])
    assert cut_at_stop(kept.text, kept) == "<4><5><6>"


def test_min_tokens_holds_back_stop_ids_and_stop_strings_as_vllm_does() -> None:
    early = _stopped(SamplingParams(max_tokens=9, min_tokens=3, stop_token_ids=[8], stop=["<9>"]),
                     [8, 9, 8, 9, 4])
    # Three tokens pass unchecked; the fourth (a stop string) ends it, its text cut where that occurrence starts.
    assert early.output_token_ids == [8, 9, 8, 9] and early.stop_reason == "<9>"
    assert cut_at_stop(early.text, early) == "<8><9><8>"
    no_max = _stopped(SamplingParams(max_tokens=None), [4] * 200)
    assert no_max.finish_reason is FinishReason.length and len(no_max.output_token_ids) == 97, "100 less the prompt"


# ---------------------------------------------------------------------------------- through the engine
@pytest.mark.slow
def test_the_options_reach_the_device_through_the_engine(make_engine: EngineFactory) -> None:
    engine = make_engine(["backend=cpu", "model.max_model_len=40"])
    plain = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)
    [base] = engine.generate([PROMPT], plain)
    forced, banned, held, stopped, whole = engine.generate([PROMPT] * 5, [
        plain.replace(logit_bias={33: 100.0}),
        plain.replace(logit_bias={t: -100.0 for t in set(base.output_token_ids)}),
        plain.replace(min_tokens=4, stop_token_ids=[base.output_token_ids[0]]),
        plain.replace(stop_token_ids=[base.output_token_ids[2]]),
        SamplingParams(max_tokens=None, ignore_eos=True, detokenize=False),
    ])
    assert forced.output_token_ids == [33] * 6
    assert not set(banned.output_token_ids) & set(base.output_token_ids)
    assert base.output_token_ids[0] not in held.output_token_ids[:4]
    stop = base.output_token_ids[2]
    assert stopped.output_token_ids == base.output_token_ids[: base.output_token_ids.index(stop) + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop)
    assert (base.stop_reason, whole.stop_reason) == (None, None)
    assert len(whole.output_token_ids) == 40 - len(PROMPT) and whole.finish_reason == "length"
    assert whole.cumulative_logprob is None, "no logprobs asked for: none summed (vLLM's V1)"
    assert base.logprobs is not None and base.cumulative_logprob is not None
    assert math.isclose(base.cumulative_logprob, sum(e[t].logprob for t, e in zip(base.output_token_ids,
                                                                                  base.logprobs, strict=True)))


@pytest.mark.slow
def test_llm_generate_raises_value_error_for_a_prompt_that_fills_the_context() -> None:
    with LLM(model="tiny", backend="cpu", max_model_len=16) as llm:
        with pytest.raises(ValueError, match=r"^prompt 1 has 16 tokens; the model.s context \(model.max_model_len=16"):
            llm.generate([[2, 3], list(range(2, 18))], use_tqdm=False)
        [fits] = llm.generate([list(range(2, 17))], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert fits.finish_reason == "length" and len(fits.output_token_ids) == 1, "15 tokens leave room for one"


GRAPH_TARGETS = [
    pytest.param("emulated", id="cuda-emulated"),
    pytest.param("native", id="cuda-native", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]),
]


@pytest.mark.slow  # an engine run, and the reference's full forward per token
@pytest.mark.parametrize("runtime", GRAPH_TARGETS)
def test_inside_the_graphs_the_new_options_give_the_references_tokens(make_engine: EngineFactory,
                                                                      runtime: str) -> None:
    # min_p, logit_bias, min_tokens' ban and a penalty beside them, in float32 with every graph captured at start
    # and async handoff: the tokens of the plain reference, which samples on the host (tests/samplerkit.py).
    overrides = ["backend=cuda", f"backend.runtime={runtime}", "model.dtype=float32", "model.max_model_len=64",
                 "engine.graph=on", "engine.graph_capture=upfront", "engine.async_token_handoff=on"]
    engine = make_engine(overrides)
    weights = seeded_weights(overrides)
    prompts = [PROMPT, PROMPT[:5], [7, 8, 9, 7, 8], PROMPT[3:]]
    [greedy] = engine.generate([prompts[2]], SamplingParams(max_tokens=3, ignore_eos=True))
    params = [
        SamplingParams(max_tokens=10, temperature=0.9, seed=3, min_p=0.2, ignore_eos=True),
        SamplingParams(max_tokens=10, logit_bias={33: 4.0, 40: -100.0}, ignore_eos=True),
        SamplingParams(max_tokens=10, min_tokens=5, stop_token_ids=[greedy.output_token_ids[0]]),
        SamplingParams(max_tokens=10, temperature=1.0, seed=5, repetition_penalty=1.3, min_p=0.05,
                       logit_bias={7: 2.0}, ignore_eos=True),
    ]
    outputs = engine.generate(prompts, params)
    for prompt, p, output in zip(prompts, params, outputs, strict=True):
        assert output.output_token_ids == reference_sampled(weights, prompt, p), f"prompt {prompt}, {p}"
    assert greedy.output_token_ids[0] not in outputs[2].output_token_ids[:5]
    metrics = engine.metrics(1.0)
    assert metrics["graph_steps"] > 0 and metrics["steps_async"] > 0
