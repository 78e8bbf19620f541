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
from corelib.ops.sampling import apply_penalties, record_tokens, reset_history

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


@pytest.mark.parametrize("overrides", [
    pytest.param(["backend=cpu"], id="cpu"),
    pytest.param(["backend=npu", "engine.async_token_handoff=on", "backend.emulator.chaos=0.3"], id="npu-async-chaos"),
])
def test_penalized_requests_get_the_reference_tokens(make_engine: EngineFactory, overrides: list[str]) -> None:
    check(make_engine, overrides)


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


def test_the_history_counts_prompt_and_outputs_apart() -> None:
    history = TokenHistory(torch.full((3, 10), 7, dtype=torch.int32), torch.full((3, 10), 7, dtype=torch.int32),
                           torch.tensor([2, 0]))
    # Two sequences packed flat: [1, 1, 4] (prompt 2 tokens, then an output) and [3, 3] (prompt 2).
    reset_history(history, torch.tensor([1, 1, 4, 3, 3]), torch.tensor([0, 1, 2, 0, 1]), torch.tensor([0, 3, 5]),
                  torch.tensor([2, 2]))
    record_tokens(history, torch.tensor([4, 9]))
    assert history.prompt_counts[2].tolist() == [0, 2, 0, 0, 0, 0, 0, 0, 0, 0]
    assert history.output_counts[2].tolist() == [0, 0, 0, 0, 2, 0, 0, 0, 0, 0]
    assert history.prompt_counts[0].tolist() == [0, 0, 0, 2, 0, 0, 0, 0, 0, 0]
    assert history.output_counts[0].tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 0, 1]
    assert history.output_counts[1].tolist() == [7] * 10, "another sequence's state was touched"
