"""A request samples with its own settings whatever request held its slot before.

With engine.max_num_seqs=1 every request runs in the same slot, one after another, so a
sampled request (temperature, top-k, top-p, seed) follows a greedy one there, and the other
way round. Its tokens must be those it samples alone in a fresh engine, and those the plain
reference samples with the same seed: the reference knows nothing of slots, so settings
left behind by the slot's previous owner (or never written) show up as a difference.
"""

from __future__ import annotations

import functools

import pytest
from support import EngineFactory, reference_sampled, seeded_weights

from corelib.engine import SamplingParams
from corelib.models.reference import reference_generate

pytestmark = pytest.mark.slow

PROMPT = [17, 4, 250, 31, 9, 77]
OTHER_PROMPT = [3, 141, 59, 26]
LONG_PROMPT = [5, 6, 7]
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.3, top_k=40, top_p=0.9, seed=1234, ignore_eos=True)
SHORT = SamplingParams(max_tokens=3, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)

NPU = ["backend=npu", "backend.emulator.chaos=0.2"]
TARGETS = [
    pytest.param(["backend=cpu"], id="cpu-eager"),
    pytest.param([*NPU, "engine.async_token_handoff=off"], id="npu-emulated-graphs-sync"),
    pytest.param([*NPU, "engine.async_token_handoff=on"], id="npu-emulated-graphs-async"),
]


@functools.cache
def reference(prompt: tuple[int, ...], sampling: SamplingParams) -> list[int]:
    """The plain reference's tokens for one request (every target runs the default model)."""
    weights = seeded_weights([])
    assert sampling.max_tokens is not None, "these requests ask a length"
    if sampling.temperature == 0:
        return reference_generate(weights, prompt, sampling.max_tokens)
    return reference_sampled(weights, prompt, sampling)


def test_the_sampled_settings_change_the_decode_steps() -> None:
    # The prefill samples from the request itself; only decode steps read the slot's settings.
    # Sampling must change the tokens there too, or a slot left greedy would go unseen.
    sampled = reference(tuple(PROMPT), SAMPLED)
    assert sampled != reference(tuple(PROMPT), GREEDY)
    after_first = SamplingParams(max_tokens=MAX_TOKENS - 1, ignore_eos=True)
    assert sampled[1:] != reference((*PROMPT, sampled[0]), after_first)


@pytest.mark.parametrize("target", TARGETS)
def test_a_sampled_request_in_a_slot_a_greedy_one_held(make_engine: EngineFactory, target: list[str]) -> None:
    overrides = [*target, "engine.max_num_seqs=1"]
    reused = make_engine(overrides).generate([OTHER_PROMPT, PROMPT], [GREEDY, SAMPLED])
    alone = make_engine(overrides).generate([PROMPT], [SAMPLED])[0]
    expected = reference(tuple(PROMPT), SAMPLED)
    assert reused[0].output_token_ids == reference(tuple(OTHER_PROMPT), GREEDY)
    assert alone.output_token_ids == expected, "a sampled request in a fresh engine did not sample its own settings"
    assert reused[1].output_token_ids == expected, (
        "a sampled request in a slot a greedy request held decoded with the old owner's settings"
    )


@pytest.mark.parametrize("target", TARGETS)
def test_a_greedy_request_in_a_slot_a_sampled_one_held(make_engine: EngineFactory, target: list[str]) -> None:
    # Two slots: a short sampled request leaves slot 0 to the greedy one while a long sampled
    # request keeps decoding, so the greedy request shares sampled decode steps, where each
    # row's own temperature decides (a batch of greedy requests alone never samples at all).
    engine = make_engine([*target, "engine.max_num_seqs=2"])
    first, long, greedy = engine.generate([OTHER_PROMPT, LONG_PROMPT, PROMPT], [SHORT, SAMPLED, GREEDY])
    assert first.output_token_ids == reference(tuple(OTHER_PROMPT), SHORT)
    assert long.output_token_ids == reference(tuple(LONG_PROMPT), SAMPLED)
    assert greedy.output_token_ids == reference(tuple(PROMPT), GREEDY), (
        "a greedy request in a slot a sampled request held sampled with the old owner's settings"
    )
