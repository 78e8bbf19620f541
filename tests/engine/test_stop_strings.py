"""Stop strings are matched in the decoded text so far, so one that spans tokens stops the request."""

from __future__ import annotations

from corelib.engine.sequence import FinishReason, SamplingParams, Sequence
from corelib.engine.stops import StopChecker

PIECES = {10: "The ", 11: "end", 12: "ing", 13: " is near", 14: ".", 15: "!"}


def detokenize(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


def run(stop: str, tokens: list[int]) -> tuple[list[FinishReason | None], str]:
    checker = StopChecker(max_model_len=64, eos_token_ids=frozenset({1}), detokenize=detokenize)
    seq = Sequence(0, "r0", [2, 3], SamplingParams(max_tokens=16, stop=stop))
    reasons = []
    for token in tokens:
        seq.output_token_ids.append(token)
        reasons.append(checker.stop_reason(seq, token))
        if reasons[-1] is not None:
            break
    return reasons, seq.text


def test_a_stop_string_across_two_tokens_stops_at_the_second() -> None:
    reasons, text = run("ding", [10, 11, 12, 13, 14])  # "en|d" + "|ing"
    assert reasons == [None, None, FinishReason.stop]
    assert text == "The ending"


def test_a_stop_string_across_three_tokens_stops_at_the_third() -> None:
    reasons, _ = run("ending is", [10, 11, 12, 13, 14])
    assert reasons == [None, None, None, FinishReason.stop]


def test_a_stop_string_inside_one_token_stops_there() -> None:
    reasons, _ = run("near", [10, 13])
    assert reasons == [None, FinishReason.stop]


def test_a_stop_string_split_exactly_at_a_token_boundary() -> None:
    reasons, _ = run("The end", [10, 11, 12])
    assert reasons == [None, FinishReason.stop]


def test_text_that_never_contains_it_runs_on() -> None:
    reasons, _ = run("the end", [10, 11, 12, 15])  # case matters
    assert reasons == [None, None, None, None]
