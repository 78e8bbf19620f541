"""Steps that carry prompt tokens replay a graph per token bucket: padded to the bucket, they give the
tokens of the same steps run eagerly, in every bucket, with chunks that end on and off block edges;
on the emulator (its graphs re-run what was captured, on static buffers) and on a GPU."""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest
import torch
from support import GPU_SMALL_FLOAT32, EngineFactory

from corelib.engine import Engine, SamplingParams
from corelib.engine.packing import InputBuilder
from corelib.engine.scheduler import ScheduledStep
from corelib.engine.sequence import Sequence
from corelib.errors import PlanRefused
from corelib.step.buckets import BucketPolicy, token_ladder
from corelib.step.layout import EngineLayout
from corelib.testing.executor import unit_config, unit_options

BUCKETS = [8, 16, 24, 40, 64]  # chunks of 8, 24 and 40 end off the 16-token block edges
EMULATED = ["backend=npu", "backend.emulator.chaos=0.2", "backend.emulator.chaos_max_ms=0.3",
            "engine.async_token_handoff=on", "model.max_model_len=256", "engine.max_num_seqs=6",
            "engine.chunked_prefill=on", "engine.max_num_batched_tokens=64", f"engine.graph_token_sizes={BUCKETS}"]


def requests(seed: int = 11) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of 1 to 150 tokens, some sharing a 20-token prefix: steps of every token count up to 64."""
    rng = random.Random(seed)
    shared = [rng.randrange(2, 500) for _ in range(20)]
    out = []
    for i in range(12):
        prompt = [rng.randrange(2, 500) for _ in range(rng.choice((1, 3, 7, 15, 16, 17, 33, 70, 150)))]
        out.append(((shared if i % 4 == 0 else []) + prompt, SamplingParams(max_tokens=rng.randint(1, 9),
                                                                            ignore_eos=True)))
    return out


def tokens_of(engine: Engine, work: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """Requests added a few at a time while steps run: steps mix decode rows and chunks of many sizes."""
    outputs: dict[str, list[int]] = {}
    pending = list(enumerate(work))
    steps = 0
    while pending or engine.has_unfinished:
        if pending and steps % 2 == 0:
            index, (prompt, sampling) = pending.pop(0)
            engine.add_request(prompt, sampling, request_id=str(index))
        for out in engine.step():
            assert out.finish_reason == "length", out.error
            outputs[out.request_id] = out.output_token_ids
        steps += 1
    return [outputs[str(i)] for i in range(len(work))]


@pytest.fixture(scope="module")
def eager() -> list[list[int]]:
    """The workload's tokens with every step run eagerly, in process: what either transport's graphs must give."""
    with Engine.from_overrides([*EMULATED, "engine.mixed_graphs=off"]) as engine:
        return tokens_of(engine, requests())


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["inproc", "shm"])
def test_padded_steps_give_the_tokens_of_eager_steps_in_every_bucket(make_engine: EngineFactory,
                                                                       eager: list[list[int]], transport: str) -> None:
    shm = ["engine.transport=shm", "engine.shm.materialization=ordered"] if transport == "shm" else []
    engine = make_engine([*EMULATED, *shm, "engine.mixed_graphs=on"])
    assert tokens_of(engine, requests()) == eager
    summary = engine.metrics(1.0)
    assert summary["graph_steps"] == summary["steps"] > summary["steps_decode"] > 0, "every step replayed a graph"
    if transport == "inproc":
        assert set(engine.local_runner.prompt_graphs) == set(BUCKETS), "the workload was meant to use every bucket"


def test_a_step_past_the_largest_bucket_runs_eagerly_with_the_same_tokens(make_engine: EngineFactory) -> None:
    base = ["backend=npu", "model.max_model_len=128", "engine.max_num_seqs=3", "engine.chunked_prefill=off",
            "engine.graph_token_sizes=[16]"]
    work = [([(7 * j) % 300 + 2 for j in range(n)], SamplingParams(max_tokens=3, ignore_eos=True)) for n in (9, 40)]
    engine = make_engine([*base, "engine.mixed_graphs=on"])
    assert tokens_of(engine, work) == tokens_of(make_engine([*base, "engine.mixed_graphs=off"]), work)
    assert engine.local_runner.num_eager_steps >= 1 and set(engine.local_runner.prompt_graphs) == {16}


def test_sampled_and_logprob_steps_share_the_sampling_graphs_of_every_bucket(make_engine: EngineFactory) -> None:
    params = [SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.8, seed=3),
              SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2)]
    prompts = [[(5 * j) % 300 + 2 for j in range(n)] for n in (30, 12)]
    base = ["backend=npu", "model.max_model_len=128", "engine.max_num_seqs=4", "engine.chunked_prefill=on",
            "engine.max_num_batched_tokens=32"]
    eager = make_engine([*base, "engine.mixed_graphs=off"]).generate(prompts, params)
    engine = make_engine([*base, "engine.mixed_graphs=on"])
    graphed = engine.generate(prompts, params)
    assert [o.output_token_ids for o in graphed] == [o.output_token_ids for o in eager]
    assert graphed[1].logprobs is not None and eager[1].logprobs is not None
    assert [list(t) for t in graphed[1].logprobs] == [list(t) for t in eager[1].logprobs]  # sampled first, top 2
    runner = engine.local_runner
    assert len(runner.sampling_graphs) <= 4 and runner.num_eager_steps == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_padded_steps_give_the_tokens_of_eager_steps_in_float32(make_engine: EngineFactory) -> None:
    base = [*GPU_SMALL_FLOAT32, "engine.max_num_seqs=16", "engine.chunked_prefill=on",
            "engine.max_num_batched_tokens=512", "engine.async_token_handoff=on"]
    rng = random.Random(5)
    work = [([rng.randrange(2, 500) for _ in range(rng.choice((1, 15, 16, 17, 100, 333, 700)))],
             SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True)) for _ in range(24)]
    eager = tokens_of(make_engine([*base, "engine.mixed_graphs=off"]), work)
    engine = make_engine([*base, "engine.mixed_graphs=on"])
    assert tokens_of(engine, work) == eager
    assert engine.local_runner.num_eager_steps == 0 and len(engine.local_runner.prompt_graphs) == len(token_ladder(512))


def test_graphs_off_refuses_mixed_graphs_on_naming_why(make_engine: EngineFactory) -> None:
    with pytest.raises(PlanRefused, match="graphs are off"):
        make_engine(["backend=npu", "engine.graph=off", "engine.mixed_graphs=on"])


def test_the_hybrid_runs_its_prompt_steps_eagerly_and_says_why(make_engine: EngineFactory) -> None:
    engine = make_engine(["backend=npu", "model=hybrid-tiny"])
    decision = engine.plan.decisions["mixed_graphs"]
    assert not decision.enabled and any("not graph-safe" in reason for reason in decision.reasons)


# ------------------------------------------------------------------------------- units
def test_the_token_ladder_grows_its_steps_with_the_size_and_ends_at_the_budget() -> None:
    ladder = token_ladder(2048)
    assert ladder[:3] == [16, 32, 48] and ladder[-1] == 2048 and 288 in ladder and 1280 in ladder
    steps = [b - a for a, b in itertools.pairwise(ladder)]
    assert steps == sorted(steps), "never a smaller step after a larger one"
    assert token_ladder(100) == [16, 32, 48, 64, 80, 96, 100] and token_ladder(10) == [10]


def test_a_step_is_padded_to_the_next_bucket_and_none_past_the_last() -> None:
    policy = BucketPolicy.build(True, [1, 2], 4, 8, False, token_sizes=[64, 16, 32])
    assert [policy.token_bucket(n) for n in (1, 16, 17, 64, 65)] == [16, 16, 32, 64, None]
    assert BucketPolicy.build(False, [1], 4, 8, False, token_sizes=[16]).token_bucket(3) is None


def test_a_decode_bucket_past_the_rows_a_step_can_have_is_clipped_to_them() -> None:
    # 40 rows at most and buckets of 32 and 64: a decode step of 33-40 rows replays the bucket of 40, not an
    # eager step that would meet kernels compiled for its row count while serving.
    policy = BucketPolicy.build(True, [1, 2, 4, 8, 16, 32, 64], 40, 8, False)
    assert policy.batch_buckets == (1, 2, 4, 8, 16, 32, 40)
    assert policy.decode_shape(36, 3)[0::2] == (40, True) and policy.decode_shape(40, 3)[0::2] == (40, True)
    # Buckets that stop short of the rows are the config's choice: past them, eager steps.
    assert BucketPolicy.build(True, [1, 2, 4], 40, 8, False).decode_shape(5, 3)[2] is False


def test_a_padded_step_leaves_its_extra_rows_empty_and_its_extra_tokens_on_the_null_block() -> None:
    config = unit_config(max_num_seqs=4, block_size=4, max_model_len=32)
    options = dataclasses.replace(unit_options(), graphs=True, mixed_graphs=True)
    layout = EngineLayout.of(config)
    builder = InputBuilder(layout)
    seqs = [Sequence(i, str(i), list(range(2, 2 + n)), SamplingParams(max_tokens=2)) for i, n in enumerate((5, 1))]
    for index, seq in enumerate(seqs):
        seq.state_index, seq.block_table = index, [1 + 2 * index, 2 + 2 * index]
    step = ScheduledStep(seqs, [0, 0], [5, 1], [True, True], [False, False])
    arena = torch.zeros(layout.arena_bytes, dtype=torch.uint8)
    tokens = layout.token_buckets(options)[0]
    fi = builder.fill(0, step, arena, layout.rows, layout.max_blocks, padded=tokens)
    views = {name: view.numpy() for name, view in fi.views().items()}
    assert fi.padded and (fi.bucket, fi.num_tokens, fi.num_seqs) == (4, tokens, 2)
    assert views["query_start"].tolist() == [0, 5, 6, 6, 6], "rows past the step's hold no tokens"
    assert not views["slot_mapping"][6:].any() and not views["input_ids"][6:].any(), "padding on the null block"
    assert np.array_equal(views["seq_lens"], [5, 1, 1, 1]) and not views["block_tables"][2:].any()
    assert views["sample_slots"][2:].tolist() == [layout.pad_state_index] * 2
