"""Logprobs computed on the device from the logits the sampler used, and n requests of one prompt
sharing its KV blocks (a partial last block copied on write): the same tokens as separate requests."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from support import EngineFactory, local_weights

from corelib.engine import Engine, SamplingParams
from corelib.engine.block_manager import BlockManager
from corelib.engine.outputs import output_of
from corelib.engine.scheduler import ScheduledStep, Scheduler, SchedulerLimits
from corelib.engine.sequence import MAX_LOGPROBS, Logprob, Sequence, TokenLogprobs
from corelib.engine.stops import StopChecker
from corelib.engine.streaming import DeltaTracker
from corelib.models.reference import reference_logits
from corelib.sampling_params import SEED_LIMIT, SamplingError, choices
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
    left_top = False
    for token, entry in zip(out.output_token_ids, out.logprobs, strict=True):
        expected = torch.log_softmax(reference_logits(local_weights(engine), context), dim=-1)
        assert next(iter(entry)) == token, "vLLM's order: the sampled token first"
        sampled = entry[token]
        assert math.isclose(sampled.logprob, float(expected[token]), abs_tol=1e-4)
        assert sampled.decoded_token is None, "no tokenizer: no text"
        top = expected.topk(4)
        ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if len(entry) == 4 or t != token)
        assert [t for _, t, _ in ranked] == top.indices.tolist(), "the most likely, ranked 1 to 4"
        assert [r for r, _, _ in ranked] == [1, 2, 3, 4]
        assert all(math.isclose(p, float(v), abs_tol=1e-4) for (_, _, p), v in zip(ranked, top.values, strict=True))
        if len(entry) == 5:  # sampled outside the top 4: its rank counts the tokens at least as likely
            assert sampled.rank == int((expected >= expected[token]).sum())
            left_top = True
        if temperature == 0:
            assert sampled.rank == 1 and len(entry) == 4, "greedy samples the most likely token"
        context.append(token)
    assert out.cumulative_logprob is not None
    assert math.isclose(out.cumulative_logprob, sum(e[t].logprob for t, e in zip(out.output_token_ids, out.logprobs,
                                                                                 strict=True)), abs_tol=1e-9)
    assert out.outputs[0].logprobs == out.logprobs and out.outputs[0].cumulative_logprob == out.cumulative_logprob
    if temperature:
        assert left_top, "sampling was meant to leave the top 4 at least once"


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
        for a, b in zip(want.logprobs, have.logprobs, strict=True):
            assert list(a) == list(b), "the same tokens, in the same order"
            assert [x.rank for x in a.values()] == [x.rank for x in b.values()]
            assert all(math.isclose(x.logprob, y.logprob, abs_tol=1e-4) for x, y in zip(a.values(), b.values(),
                                                                                       strict=True))


def device_row(step: int) -> list[float]:
    """One row of a step's logprobs as the device writes it: the sampled token's, its rank, the top values, then
    their ids."""
    return [-0.5 - step, 30.0 + step, *(-0.1 * (i + 1) for i in range(MAX_LOGPROBS)),
            *(float(200 + i) for i in range(MAX_LOGPROBS))]


def test_logprobs_0_gives_each_token_its_logprob_and_no_alternatives() -> None:
    scheduler = Scheduler(SchedulerLimits(4, 64, 64), BlockManager(32, 4), 4, StopChecker(64, frozenset()))
    asked = [None, 0, 2]
    seqs = [Sequence(i, f"r{i}", [5, 6, 7], SamplingParams(max_tokens=8, logprobs=k)) for i, k in enumerate(asked)]
    for seq in seqs:
        scheduler.add(seq)
    for step in range(3):
        scheduled = scheduler.schedule(in_flight=False, sync_check=lambda seqs: [])
        assert isinstance(scheduled, ScheduledStep) and scheduled.seqs == seqs
        tokens = [40 + step] * len(seqs)
        scheduler.postprocess(scheduled, tokens, [device_row(step)] * len(seqs))
    none, zero, two = seqs
    assert none.logprobs == [] and output_of(none, None).logprobs is None
    expected = [TokenLogprobs(40 + step, -0.5 - step, (), 30 + step) for step in range(3)]
    assert zero.logprobs == expected, "one logprob per token, and no alternatives"
    assert output_of(zero, None).logprobs == [{40 + s: Logprob(-0.5 - s, 30 + s, None)} for s in range(3)]
    [delta] = DeltaTracker(None).running([zero])
    assert delta.logprobs == expected, "streamed as they come"
    assert [t.top for t in two.logprobs] == [((200, -0.1), (201, -0.2))] * 3
    assert output_of(two, None, lambda t: f"<{t}>").logprobs == [
        {40 + s: Logprob(-0.5 - s, 30 + s, f"<{40 + s}>"), 200: Logprob(-0.1, 1, "<200>"),
         201: Logprob(-0.2, 2, "<201>")} for s in range(3)]


def test_a_step_with_only_logprobs_0_rows_asks_the_device_for_logprobs() -> None:
    def steps_asking(logprobs: int | None) -> list[bool]:
        core, executor = scripted_core()
        core.add(Sequence(0, "r0", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True, logprobs=logprobs)))
        while core.iterate():
            pass
        [done] = core.take_finished()
        assert len(done.output_token_ids) == 3
        return [submitted.fi.logprobs for submitted in executor.submitted]

    assert steps_asking(0) == [True] * 3
    assert steps_asking(None) == [False] * 3


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


def test_each_prompts_choices_take_the_seeds_after_the_earlier_prompts_ones() -> None:
    params = SamplingParams(n=3, seed=7, temperature=1.0)
    first, second = choices(params), choices(params, first=3)
    assert [c.seed for c in first] == [7, 8, 9] and [c.seed for c in second] == [10, 11, 12]
    assert all(c.n == 1 and c.temperature == 1.0 for c in [*first, *second])
    wrapped = choices(SamplingParams(n=2, seed=SEED_LIMIT - 1), first=1)
    assert [c.seed for c in wrapped] == [0, 1], "seeds stay in the sampler's range"
    unseeded = choices(SamplingParams(n=2), first=2)
    assert [c.seed for c in unseeded] == [None, None], "without a seed each choice draws its own"


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
