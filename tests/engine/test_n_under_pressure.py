"""The ``n`` requests of one prompt under KV pressure and with penalties: no request stops the engine,
and a copy of a shared block counts the sharer's tokens, never those of the block's previous user."""

from __future__ import annotations

import pytest
from support import EngineFactory

from corelib.engine import Engine, SamplingParams

TIGHT = ["backend=cpu", "engine.block_size=4", "engine.num_kv_blocks=3", "model.max_model_len=8"]


def _finish(engine: Engine, ids: list[str]) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            assert out.finish_reason == "length", out.error
            outputs[out.request_id] = out.output_token_ids
    return {i: outputs[i] for i in ids}


@pytest.mark.parametrize("extra", [
    pytest.param([], id="plain"),
    pytest.param(["engine.chunked_prefill=on", "engine.prefix_caching=on"], id="chunked-cached"),
    pytest.param(["engine.chunked_prefill=off", "engine.prefix_caching=off"], id="whole-uncached"),
])
def test_n_in_a_pool_smaller_than_its_samples_preempts_the_sharer_instead_of_stopping_the_engine(
        make_engine: EngineFactory, extra: list[str]) -> None:
    # Two usable blocks of 4: a 6-token prompt's samples share its partial second block. The first to
    # decode needs a copy of it, finds no free block and preempts its sibling, whose share then drops:
    # the block is the first's alone, and it must write in place instead of asking for a copy.
    engine = make_engine([*TIGHT, *extra])
    prompt = list(range(2, 8))
    params = [SamplingParams(max_tokens=2, ignore_eos=True) for _ in range(2)]
    alone = engine.generate([prompt], params[0])[0].output_token_ids
    ids = engine.add_requests_sharing_prompt(prompt, params)
    assert list(_finish(engine, ids).values()) == [alone, alone]
    assert engine.scheduler.num_preemptions >= 1, "the pool was meant to force a preemption"
    blocks = engine.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks - 1 and not any(blocks.ref_counts)
    [after] = engine.generate([prompt], params[0])
    assert after.output_token_ids == alone, "the engine serves on"


def test_a_copy_on_write_counts_the_sharers_tokens_in_the_penalties(make_engine: EngineFactory) -> None:
    # The block the copy lands in last held another request's tokens. A copy that took the keys and
    # values but not the token record would count those as this prompt's, and the repetition
    # penalty would pick other tokens than a request alone does.
    overrides = ["backend=cpu", "engine.block_size=4", "engine.num_kv_blocks=16", "model.max_model_len=60"]
    engine = make_engine(overrides)
    prompt = [3, 5, 7, 11, 13, 17]  # 6 tokens: the samples share a partial block, positions 4 and 5
    penalised = SamplingParams(max_tokens=6, ignore_eos=True, repetition_penalty=50.0)
    alone = make_engine(overrides).generate([prompt], penalised)[0].output_token_ids
    # Every block of the pool once held an unrelated request's tokens: the token a request alone picks
    # second (the first is sampled before the copy).
    engine.generate([[alone[1]] * 56], SamplingParams(max_tokens=4, ignore_eos=True))
    ids = engine.add_requests_sharing_prompt(prompt, [penalised, penalised])
    assert list(_finish(engine, ids).values()) == [alone, alone]
    assert engine.scheduler.num_forked == 1
