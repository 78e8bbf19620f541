"""Stop strings cost what a client could not make unbounded: their count and length are capped
when the request is built, and the per-token check looks only at the end of the text.

The check runs on the engine's thread after every token of a request that has stop strings:
were it to decode and search the whole output each time, one client's long output with many
stop strings would slow every other request, quadratically in the output's length.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from corelib.engine import stops
from corelib.engine.sequence import FinishReason, SamplingParams, Sequence
from corelib.engine.stops import StopChecker
from corelib.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingError

# ----------------------------------------------------------------------------- the bounds


def test_as_many_stop_strings_as_the_bound_are_taken() -> None:
    stop = [f"<{i}>" for i in range(MAX_STOP_STRINGS)]
    assert len(SamplingParams(stop=stop).stop_strings) == MAX_STOP_STRINGS


def test_one_stop_string_more_than_the_bound_is_refused_naming_the_field() -> None:
    with pytest.raises(SamplingError) as refused:
        SamplingParams(stop=[f"<{i}>" for i in range(MAX_STOP_STRINGS + 1)])
    assert refused.value.field == "stop"
    assert str(refused.value) == (f"stop: {MAX_STOP_STRINGS + 1} stop strings: at most {MAX_STOP_STRINGS} "
                                  "(each is matched after every token)")


def test_fifty_five_thousand_stop_strings_are_refused_in_one_short_line() -> None:
    with pytest.raises(SamplingError) as refused:
        SamplingParams.from_mapping({"stop": [f"s{i}" for i in range(55_000)]})
    assert refused.value.field == "stop" and "\n" not in str(refused.value) and len(str(refused.value)) < 200


def test_a_stop_string_as_long_as_the_bound_is_taken() -> None:
    assert SamplingParams(stop=["x" * MAX_STOP_CHARS]).stop_strings == ("x" * MAX_STOP_CHARS,)


@pytest.mark.parametrize("stop", [["x" * (MAX_STOP_CHARS + 1)], ["ok", "y" * 10**6], "z" * (MAX_STOP_CHARS + 1)])
def test_a_stop_string_longer_than_the_bound_is_refused_naming_the_field(stop: str | list[str]) -> None:
    with pytest.raises(SamplingError) as refused:
        SamplingParams(stop=stop)
    index, length = (0, len(stop)) if isinstance(stop, str) else (len(stop) - 1, len(stop[-1]))
    assert refused.value.field == "stop"
    assert str(refused.value) == (f"stop[{index}] has {length} characters: each stop string must be at most "
                                  f"{MAX_STOP_CHARS} (each is matched after every token)")


def test_a_long_list_of_non_strings_is_refused_in_one_short_line() -> None:
    with pytest.raises(SamplingError) as refused:
        SamplingParams(stop=[12345678] * MAX_STOP_STRINGS)  # type: ignore[list-item]
    assert refused.value.field == "stop" and len(str(refused.value)) < 200


# ----------------------------------------------------------------------------- the check

PIECES = {10: "The ", 11: "end", 12: "ing", 13: " is near", 14: ".", 15: "!", 16: "a", 17: "b"}


def plain(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


def checker(detokenize: Callable[[list[int]], str] = plain) -> StopChecker:
    return StopChecker(max_model_len=1 << 20, eos_token_ids=frozenset({1}), detokenize=detokenize)


def first_stop(check: StopChecker, stop: list[str], tokens: list[int]) -> tuple[int | None, Sequence]:
    """The index of the token that stops the request (None: none does), and its sequence."""
    seq = Sequence(0, "r0", [2, 3], SamplingParams(max_tokens=len(tokens) + 1, stop=stop))
    for index, token in enumerate(tokens):
        seq.output_token_ids.append(token)
        if check.stop_reason(seq, token) is FinishReason.stop:
            return index, seq
    return None, seq


def test_each_tokens_check_decodes_and_searches_as_much_however_long_the_output(
        monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[int] = []  # token ids handed to the detokenizer, per call
    searched: list[int] = []  # characters searched for a stop string, per stop string and token

    def detokenize(ids: list[int]) -> str:
        decoded.append(len(ids))
        return "".join(PIECES[i] for i in ids)

    spied_tail = stops.tail

    def tail(text: str, new_chars: int, stop: str) -> str:
        window = spied_tail(text, new_chars, stop)
        searched.append(len(window))
        return window

    monkeypatch.setattr(stops, "tail", tail, raising=False)
    tokens = [10, 11, 12, 13, 14] * 1000  # 5,000 tokens, 'The ending is near.' over and over
    found, seq = first_stop(checker(detokenize), ["never", "ending is near!"], tokens)
    assert found is None and len(seq.text) == 19_000
    assert max(decoded) <= 2, f"a token's check decoded {max(decoded)} token ids (the output has {len(tokens)})"
    assert searched, "the stop strings were not searched through stops.tail"
    # each token adds at most 8 characters (' is near'): a stop string of n characters needs n + 7 at most
    assert max(searched) <= len("ending is near!") + 7, f"searched {max(searched)} characters for one token"
    assert len(searched) == 2 * len(tokens)


@pytest.mark.parametrize("seed", range(20))
def test_the_tail_check_stops_where_searching_the_whole_text_does(seed: int) -> None:
    # a two-letter alphabet, so stop strings overlap themselves and each other, and tokens of 1 to 8 characters
    rng = random.Random(seed)
    pieces = {100 + i: "".join(rng.choice("ab") for _ in range(rng.randint(1, 8))) for i in range(12)}
    tokens = [rng.choice(list(pieces)) for _ in range(200)]
    stop = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 12))) for _ in range(rng.randint(1, 4))]
    check = checker(lambda ids: "".join(pieces[i] for i in ids))
    found, seq = first_stop(check, stop, tokens)
    expected = next((i for i in range(len(tokens))
                     if any(s in "".join(pieces[t] for t in tokens[: i + 1]) for s in stop)), None)
    assert found == expected
    assert seq.text == "".join(pieces[t] for t in tokens[: len(seq.output_token_ids)])


def test_a_stop_string_is_found_once_the_character_that_completes_it_arrives() -> None:
    # 20 and 21 are the two halves of 'é': alone, the first decodes to the replacement character
    def detokenize(ids: list[int]) -> str:
        raw = b"".join({10: b"caf", 20: b"\xc3", 21: b"\xa9", 15: b"!"}[i] for i in ids)
        return raw.decode("utf-8", errors="replace")

    found, seq = first_stop(checker(detokenize), ["café"], [10, 20, 21, 15])
    assert found == 2 and seq.text == "café"


def test_a_stop_string_longer_than_the_new_text_is_found_across_many_tokens() -> None:
    found, _ = first_stop(checker(), ["abababab"], [16, 17] * 10)
    assert found == 7


def test_a_short_stop_string_is_found_in_a_long_new_piece() -> None:
    found, _ = first_stop(checker(), ["s n"], [10, 13])  # ' is near' holds it in its middle
    assert found == 1
