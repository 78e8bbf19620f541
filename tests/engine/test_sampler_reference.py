"""The test kit's sampler (tests/samplerkit.py) against values worked out by hand, and the engine's against it.

The plain reference of the engine tests draws its tokens with the kit, so the kit is pinned
here to values computed on paper; the engine's sampler must then agree with it on rows where
each rule decides the token: a prompt token that only the repetition penalty pushes down, a
token sampled three times that the presence penalty must push down once, vLLM's top_k=-1.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from samplerkit import (
    GOLDEN,
    MASK64,
    Sampling,
    arithmetic_shift,
    candidates,
    gumbel,
    mix64,
    noise_bits,
    penalised,
    sample,
)
from support import EngineFactory, reference_sampled, seeded_weights

from corelib.engine import SamplingParams
from corelib.ops import SamplingInputs, TokenHistory
from corelib.ops.sampling import apply_penalties, gumbel_noise, sample_rows

VOCAB = 16


# ------------------------------------------------------------------------------ by hand
def test_the_penalties_by_hand() -> None:
    # Token 0 and 4 are in the prompt, 1 once and 3 twice in the output, 2 nowhere.
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -0.5])
    settings = Sampling(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = penalised(logits, prompt=[0, 4], output=[1, 3, 3], sampling=settings)
    # 0: 2 / 2. 1: -1 * 2, - 0.5 x 1, - 0.25. 2: as it was. 3: 3 / 2, - 0.5 x 2, - 0.25. 4: -0.5 * 2 (prompt only).
    assert got.tolist() == [1.0, -2.75, 0.5, 0.25, -1.0]
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, -0.5], "the caller's logits are left alone"


def test_greedy_takes_the_argmax_of_the_penalised_logits() -> None:
    logits = torch.tensor([2.0, 1.5, 0.0])
    assert sample(logits, [2], [], Sampling()) == 0
    assert sample(logits, [0], [], Sampling(repetition_penalty=2.0)) == 1, "2 / 2 falls below 1.5"
    assert sample(logits, [2], [0, 0], Sampling(frequency_penalty=0.3)) == 1, "2 - 0.3 x 2 falls below 1.5"
    assert sample(logits, [2], [0, 0], Sampling(presence_penalty=0.3)) == 0, "2 - 0.3 stays above 1.5"
    assert sample(torch.tensor([1.0, 3.0, 3.0]), [0], [], Sampling()) == 1, "the first of equal maxima"


def test_the_cuts_by_hand() -> None:
    scaled = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()  # the probabilities at temperature 1
    assert candidates(scaled, top_k=0, top_p=1.0) == [0, 1, 2, 3]
    assert candidates(scaled, top_k=3, top_p=1.0) == [0, 1, 2]
    assert candidates(scaled, top_k=0, top_p=0.45) == [0], "0.5 above token 1"
    assert candidates(scaled, top_k=0, top_p=0.6) == [0, 1], "0.8 above token 2"
    assert candidates(scaled, top_k=0, top_p=0.85) == [0, 1, 2], "0.95 above token 3"
    # top-k first, then top-p over what it left, renormalised: 0.5 / 0.8 = 0.625 above token 1.
    assert candidates(scaled, top_k=2, top_p=0.6) == [0]
    assert candidates(scaled[[3, 1, 0, 2]], top_k=0, top_p=0.6) == [2, 1], "ranked by value, not by id"


def test_the_temperature_scales_before_the_cuts() -> None:
    # softmax([2, 1, 0]) = [0.665, 0.245, 0.090]: top_p 0.6 keeps token 0 alone. At temperature 2,
    # softmax([1, .5, 0]) = [0.506, 0.307, 0.186]: 0.506 above token 1, which stays.
    logits = torch.tensor([2.0, 1.0, 0.0])
    hot = {sample(logits, [], [], Sampling(temperature=2.0, top_p=0.6, seed=s)) for s in range(200)}
    cold = {sample(logits, [], [], Sampling(temperature=1.0, top_p=0.6, seed=s)) for s in range(200)}
    assert (hot, cold) == ({0, 1}, {0})


def test_the_noise_by_hand() -> None:
    # Arithmetic shifts fill the sign: the top bit of 1 << 63 spreads; below it nothing changes.
    assert arithmetic_shift(1 << 63, 1) == 0xC000000000000000
    assert arithmetic_shift(1 << 63, 31) == 0xFFFFFFFF00000000
    assert arithmetic_shift((1 << 62) | 5, 1) == (1 << 61) | 2
    # splitmix64's finaliser of 0 is 0xE220A8397B1DCDAF with unsigned shifts; 0 + GOLDEN has its top
    # bit set, so the sign-filling shifts of the engine's int64 arithmetic give another value.
    assert GOLDEN >> 63 == 1
    assert mix64(0) == 0x21F5A9B2BCD060C4
    assert all(0 <= mix64(x) <= MASK64 for x in (0, 1, MASK64, GOLDEN))
    # (seed, position, token) -> 23 bits -> u = (bits + 1/2) / 2**23 -> -log(-log u)
    for seed, position, token, bits in [(0, 0, 0, 0x17F523), (1, 7, 42, 0x6BD684), (2**62 - 1, 511, 511, 0xDD042),
                                        (12345, 3, 2, 0x36A9BF)]:
        assert noise_bits(seed, position, token) == bits
        expected = -math.log(-math.log((bits + 0.5) / 2**23))
        assert math.isclose(float(gumbel(seed, position, [token])[0]), expected, rel_tol=1e-6)
    assert noise_bits(1, 7, 42) != noise_bits(1, 8, 42) != noise_bits(2, 7, 42) != noise_bits(1, 7, 43)


def test_a_draw_is_the_largest_scaled_logit_plus_the_noise_of_its_position() -> None:
    logits = torch.tensor([0.4, -0.2, 0.1, 0.0])
    settings = Sampling(temperature=0.5, seed=99)
    # A prompt of 2 and one output: the token drawn is at position 3, the counter of its noise.
    scores = [float(v) / 0.5 + float(g) for v, g in zip(logits, gumbel(99, 3, range(4)), strict=True)]
    assert sample(logits, [2, 2], [3], settings) == scores.index(max(scores))
    draws = {sample(logits, [2, 2], [3] * n, settings) for n in range(40)}  # each a position of its own
    assert draws == {0, 1, 2, 3}, "every token has some chance"


def test_a_sampled_request_without_a_seed_is_refused() -> None:
    with pytest.raises(ValueError, match="explicit seed"):
        Sampling(temperature=0.7)
    assert Sampling.of(SamplingParams(temperature=0.7, seed=3, top_k=5)).top_k == 5


# ---------------------------------------------------------------------- the engine's sampler
def _history(rows: list[tuple[list[int], list[int]]], vocab: int) -> TokenHistory:
    """Counts of each row's output and prompt, a state per row (reversed, so states and rows differ)."""
    states = list(range(len(rows)))[::-1]
    output = torch.zeros(len(rows), vocab, dtype=torch.int32)
    prompt = torch.zeros(len(rows), vocab, dtype=torch.int32)
    for state, (row_prompt, row_output) in zip(states, rows, strict=True):
        for token in row_output:
            output[state, token] += 1
        for token in row_prompt:
            prompt[state, token] += 1
    return TokenHistory(output, prompt, torch.tensor(states, dtype=torch.int64))


def _engine_sample(logits: torch.Tensor, rows: list[tuple[list[int], list[int]]], settings: list[Sampling],
                   ) -> tuple[list[int], torch.Tensor]:
    """The engine's tokens and penalised logits for these rows (prompt, output so far) and settings."""
    inputs = SamplingInputs.of(
        torch.tensor([len(p) + len(o) for p, o in rows], dtype=torch.int64), _history(rows, logits.shape[1]),
        temperature=[s.temperature for s in settings], top_k=[s.top_k for s in settings],
        top_p=[s.top_p for s in settings], seeds=[s.seed or 0 for s in settings],
        repetition_penalty=[s.repetition_penalty for s in settings],
        frequency_penalty=[s.frequency_penalty for s in settings],
        presence_penalty=[s.presence_penalty for s in settings])
    return sample_rows(logits, inputs).tolist(), apply_penalties(logits, inputs)


def _agree(logits: torch.Tensor, rows: list[tuple[list[int], list[int]]], settings: list[Sampling]) -> list[int]:
    tokens, engine_penalised = _engine_sample(logits, rows, settings)
    for i, ((prompt, output), s) in enumerate(zip(rows, settings, strict=True)):
        assert torch.equal(engine_penalised[i], penalised(logits[i], prompt, output, s)), f"row {i}: {s}"
        assert tokens[i] == sample(logits[i], prompt, output, s), f"row {i}: {s}"
    return tokens


def test_the_repetition_penalty_counts_the_prompts_tokens() -> None:
    # Token 7 leads, and is in the prompt only: divided by 2 it falls below token 9.
    logits = torch.zeros(2, VOCAB)
    logits[:, 7], logits[:, 9] = 3.0, 2.0
    rows = [([7, 1], []), ([7, 1], [1])]
    assert _agree(logits, rows, [Sampling(repetition_penalty=2.0)] * 2) == [9, 9]


def test_the_presence_penalty_counts_a_token_once_however_often_it_was_sampled() -> None:
    # Token 5 was sampled three times: 3 - 1 stays above token 6's 1.5; 3 - 3 x 1 would not.
    logits = torch.zeros(2, VOCAB)
    logits[:, 5], logits[:, 6] = 3.0, 1.5
    rows = [([2], [5, 5, 5]), ([2, 3], [5, 4, 5, 5])]
    assert _agree(logits, rows, [Sampling(presence_penalty=1.0)] * 2) == [5, 5]


def test_the_engines_sampler_agrees_with_the_kit_on_random_rows() -> None:
    chance = random.Random(7)
    rows: list[tuple[list[int], list[int]]] = []
    settings: list[Sampling] = []
    for _ in range(96):
        rows.append(([chance.randrange(64) for _ in range(chance.randrange(1, 12))],
                     [chance.randrange(64) for _ in range(chance.randrange(0, 8))]))
        settings.append(Sampling(temperature=chance.choice([0.0, 0.4, 1.0, 1.6]), top_k=chance.choice([0, 1, 4, 20]),
                                 top_p=chance.choice([1.0, 0.9, 0.4]), seed=chance.randrange(2**62),
                                 repetition_penalty=chance.choice([1.0, 1.5, 0.6]),
                                 frequency_penalty=chance.choice([0.0, 0.7, -0.4]),
                                 presence_penalty=chance.choice([0.0, 1.2, -0.8])))
    logits = torch.randn(len(rows), 64, generator=torch.Generator().manual_seed(7)) * 2
    _agree(logits, rows, settings)


def test_the_engines_noise_is_the_kits() -> None:
    tokens = torch.arange(VOCAB * 8)[None, :]
    for seed, position in [(0, 0), (5, 1), (2**62 - 1, 10_000), (123456789, 77)]:
        engine = gumbel_noise(torch.tensor([seed]), torch.tensor([position]), tokens)[0]
        assert torch.equal(engine, gumbel(seed, position, tokens[0].tolist())), (seed, position)


def test_top_k_minus_one_is_vllms_no_cut() -> None:
    # vLLM spells "no top-k" -1: a request may say so, and samples as one with no cut. Hot rows, where a cut shows.
    params = SamplingParams(temperature=5.0, top_k=-1, seed=21)
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(3))
    rows: list[tuple[list[int], list[int]]] = [([1, 2], [3] * n) for n in range(8)]
    tokens = _agree(logits, rows, [Sampling.of(params)] * 8)
    assert tokens == _agree(logits, rows, [Sampling(temperature=5.0, seed=21)] * 8)
    assert tokens != _agree(logits, rows, [Sampling(temperature=5.0, top_k=1, seed=21)] * 8)


@pytest.mark.slow
def test_top_k_minus_one_through_the_engine(make_engine: EngineFactory) -> None:
    overrides = ["backend=cpu"]
    params = SamplingParams(max_tokens=4, temperature=5.0, top_k=-1, seed=21, ignore_eos=True)
    [out] = make_engine(overrides).generate([[3, 4, 5]], params)
    uncut = reference_sampled(seeded_weights(overrides), [3, 4, 5], params.replace(top_k=0))
    assert out.output_token_ids == uncut
    assert uncut != reference_sampled(seeded_weights(overrides), [3, 4, 5], params.replace(top_k=1))
