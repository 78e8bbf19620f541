"""Logprobs computed on the device from the logits the sampler used, and n requests of one prompt
sharing its KV blocks (a partial last block copied on write): the same tokens as separate requests."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from support import EngineFactory, local_weights

from corelib.engine import Engine, SamplingParams
from corelib.engine.sequence import Sequence
from corelib.models.reference import reference_logits
from corelib.sampling_params import SamplingError
from corelib.testing.executor import scripted_core, unit_config, unit_options

PROMPT = [(7 * i) % 300 + 2 for i in range(37)]  # 37 tokens: the 36 shared end inside a block of 16


def run(engine: Engine, ids: list[str]) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            outputs[out.request_id] = out.output_token_ids
            if out.request_id in ids:
                assert out.finish_reason == "length", out.error
    return {i: outputs[i] for i in ids}


# ------------------------------------------------------------------------------- logprobs
@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_logprobs_are_those_of_the_models_logits_for_each_sampled_token(make_engine: EngineFactory,
                                                                        temperature: float) -> None:
    engine = make_engine(["backend=cpu"])
    [out] = engine.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=4,
                                                     temperature=temperature, seed=5))
    assert out.logprobs is not None and len(out.logprobs) == 8
    context = list(PROMPT)
    for token, scored in zip(out.output_token_ids, out.logprobs, strict=True):
        expected = torch.log_softmax(reference_logits(local_weights(engine), context), dim=-1)
        assert scored.token_id == token and math.isclose(scored.logprob, float(expected[token]), abs_tol=1e-4)
        top = expected.topk(4)
        assert [t for t, _ in scored.top] == top.indices.tolist(), "the most likely first"
        assert all(math.isclose(p, float(v), abs_tol=1e-4) for (_, p), v in zip(scored.top, top.values, strict=True))
        if temperature == 0:
            assert scored.top[0][0] == token, "greedy samples the most likely token"
        context.append(token)
    if temperature:
        assert any(t.top[0][0] != t.token_id for t in out.logprobs), "sampling was meant to leave the likeliest"


@pytest.mark.parametrize("overrides", [
    pytest.param(["backend=npu", "backend.emulator.chaos=0.2", "engine.async_token_handoff=on"], id="npu-async-chaos"),
    pytest.param(["backend=npu", "engine.transport=shm", "engine.async_token_handoff=on"], id="npu-shm"),
])
@pytest.mark.slow
def test_logprobs_reach_the_host_the_same_through_graphs_async_handoff_and_shm(
        make_engine: EngineFactory, overrides: list[str]) -> None:
    params = [SamplingParams(max_tokens=6, ignore_eos=True, logprobs=k) for k in (None, 0, 20)]
    params.append(SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, seed=3, logprobs=2))
    prompts = [PROMPT, PROMPT[:5], PROMPT[:20], PROMPT[3:]]
    expected = make_engine(["backend=cpu"]).generate(prompts, params)
    got = make_engine(overrides).generate(prompts, params)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in expected]
    assert got[0].logprobs is None, "a request that asked for none gets none"
    for want, have in zip(expected[1:], got[1:], strict=True):
        assert want.logprobs is not None and have.logprobs is not None
        assert [len(t.top) for t in have.logprobs] == [len(t.top) for t in want.logprobs]
        for a, b in zip(want.logprobs, have.logprobs, strict=True):
            assert a.token_id == b.token_id and math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("value", [21, -1])
def test_logprobs_outside_0_to_20_are_refused_naming_the_field(value: int) -> None:
    with pytest.raises(SamplingError, match=rf"^logprobs={value}: must be in \[0, 20\] or None$") as refused:
        SamplingParams(max_tokens=2, logprobs=value)
    assert refused.value.field == "logprobs"


# ------------------------------------------------------------------------------- n
SHARING = [
    pytest.param(["backend=cpu"], id="cpu"),
    pytest.param(["backend=npu", "backend.emulator.chaos=0.2", "engine.async_token_handoff=on"], id="npu-async-chaos"),
    pytest.param(["backend=npu", "engine.transport=shm", "engine.async_token_handoff=on"], id="npu-shm"),
]


@pytest.mark.parametrize("overrides", SHARING)
@pytest.mark.parametrize("length", [1, 17, 37], ids=lambda n: f"prompt{n}")
@pytest.mark.slow
def test_n_requests_of_one_prompt_give_the_tokens_of_separate_ones(make_engine: EngineFactory,
                                                                  overrides: list[str], length: int) -> None:
    prompt = PROMPT[:length]
    params = [SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=s) for s in range(3)]
    params.append(SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1))
    engine = make_engine(overrides)
    alone = [o.output_token_ids for o in engine.generate([prompt] * len(params), params)]
    ids = engine.add_requests_sharing_prompt(prompt, params)
    assert list(run(engine, ids).values()) == alone
    assert engine.scheduler.num_forked == len(params) - 1
    blocks = engine.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks - 1 and not any(blocks.ref_counts)


def _shared(length: int) -> tuple[list[int], list[int]]:
    """On the scripted device: the tokens each step fed, and the KV blocks it copied first."""
    config = unit_config(max_num_seqs=4, block_size=4, max_model_len=64)
    options = dataclasses.replace(unit_options(), share_prompt_blocks=True)
    core, executor = scripted_core(config, options)
    prompt = list(range(2, 2 + length))
    core.scheduler.add_group([Sequence(i, str(i), prompt, SamplingParams(max_tokens=3, ignore_eos=True))
                              for i in range(3)])
    while core.iterate():
        pass
    assert {tuple(s.output_token_ids) for s in core.take_finished()} == {(2 + length, 3 + length, 4 + length)}
    return [s.fi.num_tokens for s in executor.submitted], [s.fi.num_copies for s in executor.submitted]


def test_the_prompt_is_fed_once_and_a_shared_partial_block_is_copied_before_it_is_written() -> None:
    fed, copies = _shared(10)  # 9 shared tokens: two full blocks and one of 1 token, written next at position 9
    assert fed[0] == 10, "the first request feeds the whole prompt"
    assert fed[1] == 3, "then one token each: the first request's next, the others' last prompt token"
    assert copies[1] == 2, "two of the three holders of the partial block copy it; the last writes in place"
    fed, copies = _shared(9)  # 8 shared tokens end on a block edge: nothing to copy
    assert fed[:2] == [9, 3] and sum(copies) == 0


def test_a_request_whose_prompt_owner_ends_before_it_samples_runs_on_its_own(make_engine: EngineFactory) -> None:
    engine = make_engine(["backend=cpu", "engine.chunked_prefill=on", "engine.max_num_batched_tokens=16"])
    params = [SamplingParams(max_tokens=4, ignore_eos=True) for _ in range(3)]
    first, *others = engine.add_requests_sharing_prompt(PROMPT, params)
    engine.step()  # the first chunk of 16: no token yet
    assert engine.abort(first)
    outputs = run(engine, others)
    alone = engine.generate([PROMPT], params[0])[0].output_token_ids
    assert list(outputs.values()) == [alone, alone] and engine.scheduler.num_forked == 0
