"""The same greedy float32 tokens whatever a step holds: chunked prefill on or off, chunk sizes 16 / 64 /
512, prefix caching on or off; on the cpu and on emulated npu under chaos, in process and over
ordered SHM. Every KV block is free at the end, and a pool too small for every cached prefix
evicts them without losing a request or changing a token."""

from __future__ import annotations

import random

import pytest
from support import EngineFactory

from corelib.engine import Engine, SamplingParams

pytestmark = pytest.mark.slow

SYSTEM = [(i * 37) % 400 + 3 for i in range(70)]  # a shared system prompt: 4 full blocks and a part
BASE = ["model.max_model_len=384", "engine.max_num_seqs=6"]


def workload(seed: int = 3) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of 1 to 300 tokens, a third starting with the shared system prompt, two of them exactly it."""
    rng = random.Random(seed)
    requests = []
    for i in range(14):
        if i % 3 == 0:
            prompt = SYSTEM + [rng.randrange(2, 500) for _ in range(rng.randint(0, 40))]
        else:
            prompt = [rng.randrange(2, 500) for _ in range(rng.choice((1, 5, 17, 64, 150, 300)))]
        requests.append((prompt, SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True)))
    return requests


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """A few requests up front, the rest while steps are in flight (so shared prefixes are cached)."""
    outputs: dict[str, list[int]] = {}
    pending = list(enumerate(requests))
    for index, (prompt, sampling) in pending[:4]:
        engine.add_request(prompt, sampling, request_id=str(index))
    pending = pending[4:]
    steps = 0
    while pending or engine.has_unfinished:
        if pending and steps % 3 == 0:
            index, (prompt, sampling) = pending.pop(0)
            engine.add_request(prompt, sampling, request_id=str(index))
        for out in engine.step():
            assert out.finish_reason == "length", out.error
            outputs[out.request_id] = out.output_token_ids
        steps += 1
    blocks = engine.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks - 1 and not any(blocks.ref_counts), "a KV block is still held"
    return [outputs[str(i)] for i in range(len(requests))]


def settings(chunk: int | None, caching: bool) -> list[str]:
    chunked = ["engine.chunked_prefill=on", f"engine.max_num_batched_tokens={chunk}"] if chunk else [
        "engine.chunked_prefill=off"]
    return [*chunked, f"engine.prefix_caching={'on' if caching else 'off'}"]


CONFIGS = [(None, False), (None, True), (16, False), (16, True), (64, True), (512, False), (512, True)]


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    from corelib.engine import Engine as Built

    with Built.from_overrides(["backend=cpu", *BASE, *settings(None, False)]) as engine:
        return run(engine, workload())


@pytest.mark.parametrize(("chunk", "caching"), CONFIGS, ids=[f"chunk{c}-cache{int(p)}" for c, p in CONFIGS])
def test_cpu_tokens_do_not_depend_on_chunking_or_prefix_caching(
        make_engine: EngineFactory, expected: list[list[int]], chunk: int | None, caching: bool) -> None:
    engine = make_engine(["backend=cpu", *BASE, *settings(chunk, caching)])
    assert run(engine, workload()) == expected
    summary = engine.metrics(1.0)
    if caching:
        assert summary["prefix_cache_hit_tokens"] >= 4 * 16, "the shared system prompt was meant to be found"
    if chunk == 16:
        assert summary["steps_prefill"] > 20, "prompts of up to 300 tokens were meant to take many chunks"


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["inproc", "shm"])
@pytest.mark.parametrize(("chunk", "caching"), [(16, True), (64, False), (512, True)])
def test_emulated_npu_under_chaos_with_async_handoff_gives_the_same_tokens(
        make_engine: EngineFactory, expected: list[list[int]], transport: str, chunk: int, caching: bool) -> None:
    shm = ["engine.transport=shm", "engine.shm.materialization=ordered"] if transport == "shm" else []
    engine = make_engine(["backend=npu", "backend.emulator.chaos=0.2", "backend.emulator.chaos_max_ms=0.5",
                          "engine.async_token_handoff=on", *shm, *BASE, *settings(chunk, caching)])
    assert run(engine, workload()) == expected
    summary = engine.metrics(1.0)
    assert summary["steps_async"] == summary["steps"] and summary["graph_steps"] > 0


@pytest.mark.parametrize("mixed", ["off", "on"])
def test_decode_steps_replay_the_decode_graphs_and_steps_with_chunks_their_token_buckets(
        make_engine: EngineFactory, expected: list[list[int]], mixed: str) -> None:
    engine = make_engine(["backend=npu", *BASE, *settings(16, False), f"engine.mixed_graphs={mixed}"])
    assert run(engine, workload()) == expected
    summary = engine.metrics(1.0)
    runner = engine.local_runner
    assert summary["steps_decode"] > 0 and summary["steps_prefill"] > 0
    if mixed == "off":
        assert summary["graph_steps"] == runner.num_graph_steps == summary["steps_decode"], "every decode bucket"
        assert runner.num_eager_steps == summary["steps_prefill"], "each step with chunks ran eagerly"
    else:
        assert summary["graph_steps"] == runner.num_graph_steps == summary["steps"], "every step replayed graphs"
        assert runner.num_eager_steps == 0 and set(runner.prompt_graphs) == {16}, "one token bucket: the budget"


def test_the_hybrid_carries_its_convolution_state_from_chunk_to_chunk(make_engine: EngineFactory) -> None:
    requests = [(prompt, params) for prompt, params in workload() if len(prompt) > 20]
    whole = run(make_engine(["backend=cpu", "model=hybrid-tiny", *BASE, *settings(None, False)]), requests)
    assert run(make_engine(["backend=cpu", "model=hybrid-tiny", *BASE, *settings(16, False)]), requests) == whole


def test_eviction_under_memory_pressure_loses_nothing_and_changes_no_token(make_engine: EngineFactory,
                                                                           expected: list[list[int]]) -> None:
    engine = make_engine(["backend=cpu", *BASE, "engine.num_kv_blocks=48", *settings(64, True)])
    assert run(engine, workload()) == expected
    assert engine.scheduler.blocks.stats.evicted_blocks > 0, "the pool was meant to be too small to keep every prefix"
