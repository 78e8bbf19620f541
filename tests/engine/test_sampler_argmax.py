"""A step whose rows are all greedy takes the argmax of its processed logits (logit_bias, min_tokens' ban, the
penalties, a grammar's mask): what the draw gives a greedy row, without the draw's noise over the vocabulary."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support import EngineFactory, counted_sorts

from corelib.engine import SamplingParams
from corelib.ops import SamplingInputs
from corelib.ops.sampling import sample_rows
from corelib.step.runner import Sampler
from corelib.testing.op_cases import SampleCase


def built(rows: int, seed: int = 0) -> tuple[torch.Tensor, SamplingInputs]:
    """Logits and every row greedy, with logit_bias, min_tokens' bans and penalties (the op conformance case)."""
    logits, sampling = SampleCase(rows, 1000, argmax=True).build(seed, torch.device("cpu"))
    assert isinstance(logits, torch.Tensor) and isinstance(sampling, SamplingInputs) and not sampling.draws
    return logits, sampling


def test_without_the_draw_greedy_rows_take_the_tokens_the_draw_gives_them() -> None:
    for seed in range(4):
        logits, sampling = built(16, seed)
        drawn = sample_rows(logits.clone(), dataclasses.replace(sampling, draws=True))
        assert torch.equal(sample_rows(logits.clone(), sampling), drawn)
        assert not torch.equal(drawn, logits.argmax(dim=-1)), "the bias, bans and penalties change some rows' token"


def test_without_the_draw_nothing_sorts_the_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    logits, sampling = built(4)
    sorts = counted_sorts(monkeypatch)
    sample_rows(logits, sampling)
    assert sorts == []
    sample_rows(logits, dataclasses.replace(sampling, draws=True, cuts=True))
    assert sorts == [1000]


PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]


@pytest.mark.parametrize(("params", "want"), [
    (SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={7: 3.0}), Sampler.processed),
    (SamplingParams(max_tokens=6, ignore_eos=True, repetition_penalty=1.3), Sampler.processed),
    (SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=2), Sampler.draw),
    (SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, top_p=0.9, seed=2), Sampler.cut),
    (SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.2, top_k=20, seed=4), Sampler.cut),
])
def test_the_decode_graphs_run_the_lightest_sampler_their_rows_need(make_engine: EngineFactory,
                                                                     params: SamplingParams, want: Sampler) -> None:
    # the argmax of the processed logits where no row draws; the draw without a sort where no row cuts
    engine = make_engine(["backend=npu", "engine.async_token_handoff=on", "engine.graph_capture=lazy"])
    reference = make_engine(["backend=cpu"]).generate(PROMPTS, [params] * 2)
    outputs = engine.generate(PROMPTS, [params] * 2)
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in reference]
    used = {sampler for _, _, sampler, _ in engine.local_runner.graphs}
    assert used == {want}, used
