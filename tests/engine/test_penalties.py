"""Presence, frequency and repetition penalties: on the device, the tokens of the plain reference.

The reference (tests/support.py) counts each request's prompt and outputs on the host, a full
forward per token; the engine keeps the counts on the device by state index. The cases mix
penalized rows with plain greedy and sampled ones in one batch, reuse state indices, replay
graphs with async handoff under chaos, and preempt (a recomputed sequence brings its outputs
back in its prefill, which must count as sampled, not as prompt).
"""

from __future__ import annotations

import pytest
import torch
from support import EngineFactory, reference_sampled, seeded_weights

from corelib.engine import Engine, SamplingParams
from corelib.ops import SamplingInputs, TokenHistory
from corelib.ops.sampling import apply_penalties, count_history

PROMPTS = [[5, 6, 7, 5, 5], [100] * 6, list(range(30, 42)), [9, 8], [200, 201, 200], [3, 4, 5, 6]]
PENALIZED = [
    SamplingParams(max_tokens=20, repetition_penalty=1.6, ignore_eos=True),
    SamplingParams(max_tokens=14, presence_penalty=1.5, frequency_penalty=0.7, ignore_eos=True),
    SamplingParams(max_tokens=18, ignore_eos=True),  # greedy, no penalty, beside penalized rows
    SamplingParams(max_tokens=16, temperature=0.9, top_k=30, seed=11, frequency_penalty=1.2, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=1.1, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=22, repetition_penalty=0.7, presence_penalty=-0.5, ignore_eos=True),  # encouraged
]


def check(make_engine: EngineFactory, overrides: list[str], penalized: list[SamplingParams] = PENALIZED) -> Engine:
    engine = make_engine(overrides)
    weights = seeded_weights(overrides)
    outputs = engine.generate(PROMPTS, penalized)
    for prompt, params, output in zip(PROMPTS, penalized, outputs, strict=True):
        assert output.output_token_ids == reference_sampled(weights, prompt, params), f"prompt {prompt}, {params}"
    return engine


@pytest.mark.slow  # an engine run, and the reference's full forward per token
@pytest.mark.parametrize("overrides", [
    pytest.param(["backend=cpu"], id="cpu"),
    pytest.param(["backend=npu", "engine.async_token_handoff=on", "backend.emulator.chaos=0.3"], id="npu-async-chaos"),
])
def test_penalized_requests_get_the_reference_tokens(make_engine: EngineFactory, overrides: list[str]) -> None:
    check(make_engine, overrides)


@pytest.mark.slow  # an engine run, and the reference's full forward per token
def test_a_preempted_penalized_request_keeps_its_tokens(make_engine: EngineFactory) -> None:
    overrides = ["backend=cpu", "engine.max_num_seqs=4", "engine.num_kv_blocks=7", "model.max_model_len=80"]
    # Frequency and presence count outputs only: a recomputed prefill that took its outputs for prompt
    # would drop them. Every row has them, negative (outputs are encouraged, so a row keeps returning to
    # them and losing their counts shows), so whichever sequence is preempted shows it.
    counted = [p.replace(presence_penalty=-2.0, frequency_penalty=-0.5, repetition_penalty=1.0) for p in PENALIZED]
    engine = check(make_engine, overrides, counted)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for all requests at once"


def test_neutral_penalties_leave_the_logits_exactly_as_they_were() -> None:
    logits = torch.randn(3, 50)
    history = TokenHistory(torch.randint(0, 4, (5, 50), dtype=torch.int32),
                           torch.randint(0, 2, (5, 50), dtype=torch.int32), torch.tensor([4, 0, 2]))
    sampling = SamplingInputs.of(torch.zeros(3, dtype=torch.int64), history)
    assert torch.equal(apply_penalties(logits, sampling), logits)


def test_the_history_counts_prompt_and_outputs_apart_from_each_rows_own_blocks() -> None:
    history = TokenHistory(torch.full((2, 10), 7, dtype=torch.int32), torch.full((2, 10), 7, dtype=torch.int32),
                           torch.arange(2))
    # Blocks of 2 slots. Row 0 holds [1, 1 | 4] in blocks 1 and 3 (a prompt of 2, then an output); row 1
    # holds [3, 3] in block 2 (a prompt of 2). Slots past a row's length hold another sequence's tokens.
    slot_tokens = torch.tensor([9, 9, 1, 1, 3, 3, 4, 8, 9, 9])
    count_history(history, slot_tokens, torch.tensor([[1, 3], [2, 4]], dtype=torch.int32), 2,
                  seq_lens=torch.tensor([3, 2]), prompt_lens=torch.tensor([2, 2]))
    assert history.prompt_counts[0].tolist() == [0, 2, 0, 0, 0, 0, 0, 0, 0, 0]
    assert history.output_counts[0].tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    assert history.prompt_counts[1].tolist() == [0, 0, 0, 2, 0, 0, 0, 0, 0, 0]
    assert history.output_counts[1].tolist() == [0] * 10, "a slot past the row's length was counted"


@pytest.mark.slow  # an engine run, and the reference's full forward per token
@pytest.mark.parametrize("overrides", [
    pytest.param(["engine.chunked_prefill=on", "engine.max_num_batched_tokens=16"], id="chunked"),
    pytest.param(["engine.prefix_caching=on"], id="prefix-cache"),
])
def test_penalties_count_the_tokens_of_chunks_and_cached_prefixes(make_engine: EngineFactory,
                                                                   overrides: list[str]) -> None:
    # A shared beginning longer than a block: the later prompts find it in the cache (or are fed in
    # chunks), and their penalties must still count it as their prompt.
    shared = list(range(40, 60))
    prompts = [[*shared, 5, 6, 7], [*shared, 100, 100], [*shared, 9]]
    engine = make_engine(["backend=cpu", *overrides])
    weights = seeded_weights(["backend=cpu", *overrides])
    params = [PENALIZED[0], PENALIZED[1], PENALIZED[5]]
    for prompt, p in zip(prompts, params, strict=True):  # one at a time: each finds the others' blocks
        [output] = engine.generate([prompt], p)
        assert output.output_token_ids == reference_sampled(weights, prompt, p), f"prompt {prompt}, {p}"


@pytest.mark.slow  # an engine run, and the reference's full forward per token
def test_n_samples_sharing_the_prompts_blocks_count_the_prompt(make_engine: EngineFactory) -> None:
    engine = make_engine(["backend=cpu"])
    weights = seeded_weights(["backend=cpu"])
    prompt = list(range(30, 50))
    params = SamplingParams(n=3, max_tokens=12, temperature=0.9, seed=4, repetition_penalty=1.5,
                            frequency_penalty=0.8, ignore_eos=True)
    [output] = engine.generate([prompt], params)
    assert engine.scheduler.num_forked > 0, "the samples were meant to share the prompt's blocks"
    for i, choice in enumerate(output.outputs):
        single = params.replace(n=1, seed=4 + i)
        assert choice.token_ids == reference_sampled(weights, prompt, single), f"choice {i}"
