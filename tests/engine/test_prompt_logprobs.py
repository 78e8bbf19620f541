"""prompt_logprobs: each prompt token's logprob, rank and the most likely tokens at its place, computed on the
device from the logits at every prompt position of the steps that feed them (chunked, never from the prefix
cache), and what they leave unchanged: the tokens of every request, its own and those beside it."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import pytest
import torch
from support import EngineFactory, seeded_weights

from corelib.engine import Engine, SamplingParams
from corelib.engine.outputs import PromptLogprobs
from corelib.models.llama import ModelWeights
from corelib.models.reference import reference_generate, reference_prompt_logits
from corelib.sampling_params import MAX_LOGPROBS, SamplingError
from corelib.step import fields
from corelib.step.arena import ArenaLayout, Field
from corelib.step.forward_input import ForwardInput
from corelib.transport import wire

# Chunks of 16 tokens, prompts cached; the emulated npu captures its steps with prompt tokens too.
OVERRIDES = ["backend=npu", "engine.chunked_prefill=on", "engine.max_num_batched_tokens=16",
             "engine.prefix_caching=on", "engine.mixed_graphs=on"]
PROMPT = [(7 * i) % 300 + 2 for i in range(37)]  # 37 tokens: three chunks of the budget
OTHER = [(11 * i) % 290 + 5 for i in range(9)]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    built = Engine.from_overrides(OVERRIDES)
    try:
        yield built
    finally:
        built.close()


@pytest.fixture(scope="module")
def weights() -> ModelWeights:
    return seeded_weights(OVERRIDES)


def check(prompt: Sequence[int], got: PromptLogprobs | None, k: int, weights: ModelWeights) -> None:
    """``got`` is vLLM's: None first, then per prompt token {token: Logprob}, the token itself first, then the k
    likeliest by rank, each logprob that of the plain reference's log_softmax at the position before."""
    assert got is not None and len(got) == len(prompt) and got[0] is None
    expected = torch.log_softmax(reference_prompt_logits(weights, prompt), dim=-1)
    for i in range(1, len(prompt)):
        entry, token, ref = got[i], prompt[i], expected[i - 1]
        assert entry is not None and next(iter(entry)) == token, "the prompt token first"
        assert math.isclose(entry[token].logprob, float(ref[token]), abs_tol=1e-4), i
        top = ref.topk(k)
        ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if len(entry) == k or t != token)
        assert [t for _, t, _ in ranked] == top.indices.tolist() and [r for r, _, _ in ranked] == list(range(1, k + 1))
        assert all(math.isclose(p, float(v), abs_tol=1e-4) for (_, _, p), v in zip(ranked, top.values, strict=True))
        if len(entry) == k + 1 or k == 0:  # outside the top k: its rank counts the tokens at least as likely
            assert entry[token].rank == int((ref >= ref[token]).sum())
        assert entry[token].decoded_token is None, "no tokenizer: no text"


def test_sampling_params_bound_prompt_logprobs_as_logprobs() -> None:
    assert SamplingParams(prompt_logprobs=MAX_LOGPROBS).prompt_logprobs == MAX_LOGPROBS
    for bad in (-1, MAX_LOGPROBS + 1):
        with pytest.raises(SamplingError, match=r"prompt_logprobs=.*must be in \[0, 20\]"):
            SamplingParams(prompt_logprobs=bad)


@pytest.mark.parametrize("k", [0, 3])
def test_each_prompt_token_has_the_references_logprob_rank_and_top_k_over_chunks(
        engine: Engine, weights: ModelWeights, k: int) -> None:
    [out] = engine.generate([PROMPT], SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=k))
    check(PROMPT, out.prompt_logprobs, k, weights)
    assert out.output_token_ids == reference_generate(weights, PROMPT, 2)


def test_a_request_beside_one_asking_for_them_samples_the_same_tokens(engine: Engine, weights: ModelWeights) -> None:
    plain = SamplingParams(max_tokens=4, ignore_eos=True)
    alone = engine.generate([OTHER], plain)[0].output_token_ids
    asking, beside = engine.generate([PROMPT, OTHER], [plain.replace(prompt_logprobs=2), plain])
    assert beside.prompt_logprobs is None and beside.output_token_ids == alone == reference_generate(weights, OTHER, 4)
    assert asking.output_token_ids == reference_generate(weights, PROMPT, 4)
    check(PROMPT, asking.prompt_logprobs, 2, weights)


def test_a_cached_prompt_is_computed_again_for_its_prompt_logprobs(engine: Engine, weights: ModelWeights) -> None:
    prompt = [*OTHER, *PROMPT]  # 46 tokens: two full blocks the cache keeps
    engine.generate([prompt], SamplingParams(max_tokens=1))
    hits = engine.stats().prefix_cache_hit_tokens
    assert engine.generate([prompt], SamplingParams(max_tokens=1))[0].prompt_logprobs is None
    assert engine.stats().prefix_cache_hit_tokens > hits, "the prompt is in the cache"
    hits = engine.stats().prefix_cache_hit_tokens
    [out] = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))
    check(prompt, out.prompt_logprobs, 1, weights)
    assert engine.stats().prefix_cache_hit_tokens == hits, "a request asking for them takes no cached block"


def test_n_samples_give_the_prompts_logprobs_once(engine: Engine, weights: ModelWeights) -> None:
    [out] = engine.generate([PROMPT], SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=4, prompt_logprobs=1))
    assert len(out.outputs) == 2
    check(PROMPT, out.prompt_logprobs, 1, weights)


def test_the_wire_carries_the_prompt_positions_and_their_logprobs() -> None:
    base = fields.step_layout(8, 2, 3)
    layout = fields.with_token_mask(fields.with_prompt_logprobs(base, 5), 2, 4)
    fi = ForwardInput(1, 2, 2, 8, 4, 3, False, layout, torch.zeros(layout.nbytes, dtype=torch.uint8),
                      prompt_logprobs=5)
    header = wire.input_header(fi, 0.0)
    header.payload_len = layout.nbytes
    assert wire.input_of(header, fi.arena, "test").prompt_logprobs == 5
    assert header.input_layout("test").names[-2:] == (fields.PROMPT_LOGPROBS, fields.TOKEN_MASK)
    plain = ArenaLayout.of([*base.fields, Field(fields.TOKEN_MASK, torch.int32, (2, 4))])
    masked = wire.input_header(ForwardInput(1, 2, 2, 8, 4, 3, False, plain, fi.arena), 0.0)
    masked.payload_len = plain.nbytes
    assert wire.input_of(masked, fi.arena, "test").prompt_logprobs == 0
    rows = [[float(i + j) for j in range(fields.LOGPROB_WIDTH)] for i in range(3)]
    result = wire.WireResult(1, False, False, [4, 5], None, None, 0.0, rows[:2], rows)
    back = wire.decode_result(wire.result_header(result, 0.0), wire.encode_result(result))
    assert back.logprobs == rows[:2] and back.prompt_logprobs == rows
    assert len(wire.encode_result(result)) <= wire.result_bytes(2, 3)


@pytest.mark.slow
def test_prompt_logprobs_come_back_through_shm() -> None:
    overrides = [*OVERRIDES, "engine.transport=shm", "engine.async_token_handoff=on"]
    with Engine.from_overrides(overrides) as engine:
        plain = SamplingParams(max_tokens=3, ignore_eos=True)
        asking, beside = engine.generate([PROMPT, OTHER], [plain.replace(prompt_logprobs=4), plain])
    weights = seeded_weights(overrides)
    check(PROMPT, asking.prompt_logprobs, 4, weights)
    assert beside.prompt_logprobs is None and beside.output_token_ids == reference_generate(weights, OTHER, 3)


def test_the_cpu_backend_computes_them_too(make_engine: EngineFactory) -> None:
    overrides = ["backend=cpu", "engine.chunked_prefill=on", "engine.max_num_batched_tokens=16"]
    [out] = make_engine(overrides).generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=2))
    check(PROMPT, out.prompt_logprobs, 2, seeded_weights(overrides))
