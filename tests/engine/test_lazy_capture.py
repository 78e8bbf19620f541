"""Graph capture that fits the work: on the emulator each decode graph is captured when a step first needs it."""

from __future__ import annotations

import pytest
from support import EngineFactory

from corelib.engine import SamplingParams
from corelib.step.runner import Sampler

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
PARAMS = SamplingParams(max_tokens=20, ignore_eos=True)


@pytest.mark.slow
def test_the_emulator_captures_only_the_graphs_the_work_uses(make_engine: EngineFactory) -> None:
    lazy = make_engine(["backend=cuda", "backend.runtime=emulated", "engine.async_token_handoff=on"])
    runner = lazy.local_runner
    assert lazy.options.lazy_capture and runner.graphs == {}, "nothing is captured before a step needs it"
    want = [o.output_token_ids for o in make_engine(["backend=cpu"]).generate(PROMPTS, PARAMS)]
    assert [o.output_token_ids for o in lazy.generate(PROMPTS, PARAMS)] == want
    used = {(rows, kv) for rows, kv, *_ in runner.graphs}
    assert used and used < set(runner.buckets.shapes()), "only the buckets three requests reach"
    assert lazy.metrics(1.0)["graph_steps"] > 0


def test_upfront_capture_takes_every_bucket_at_start(make_engine: EngineFactory) -> None:
    engine = make_engine(["backend=npu", "engine.graph_capture=upfront", "engine.graph_batch_sizes=[1,2,4]"])
    assert not engine.options.lazy_capture
    assert {(rows, kv) for rows, kv, *_ in engine.local_runner.graphs} == set(engine.local_runner.buckets.shapes())
    # every sampling variant too: a first sampled or logprobs step at a new batch size captures nothing
    assert set(engine.local_runner.graphs) == {(rows, kv, sampler, logprobs)
                                               for rows, kv in engine.local_runner.buckets.shapes()
                                               for sampler in Sampler for logprobs in (False, True)}
