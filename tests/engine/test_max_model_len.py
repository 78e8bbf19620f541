"""A request that reaches model.max_model_len stops there with finish_reason 'length'.

max_tokens and ignore_eos would let these requests run on; the model's length is the only
limit. Each must end with exactly max_model_len - prompt_len tokens, the same tokens a model
with room to spare gives, on the synchronous and the async path (one step in flight past the
limit must be dropped, not run at a position the model has no room for).
"""

from __future__ import annotations

import pytest
from support import EngineFactory

from corelib.engine import SamplingParams

MAX_LEN = 40  # block_size 16: the last block is partly used, so the stop is not at a block edge
PROMPTS = [
    list(range(50, 50 + MAX_LEN - 1)),  # room for one token: the prefill's
    list(range(100, 100 + MAX_LEN - 2)),  # one decode step
    list(range(200, 200 + MAX_LEN - 9)),  # several decode steps, across no block edge
    list(range(300, 300 + MAX_LEN - 20)),  # a decode step crosses into the third block
]
UNBOUNDED = SamplingParams(max_tokens=10_000, ignore_eos=True)
NPU = ["backend=npu", "backend.runtime=emulated", "backend.emulator.chaos=0.2", "engine.max_num_seqs=4"]


@pytest.mark.parametrize("handoff", ["off", "on"])
@pytest.mark.slow
def test_requests_stop_at_the_models_length(make_engine: EngineFactory, handoff: str) -> None:
    engine = make_engine([*NPU, f"model.max_model_len={MAX_LEN}", f"engine.async_token_handoff={handoff}"])
    outputs = engine.generate(PROMPTS, UNBOUNDED)
    roomy = make_engine([*NPU, "engine.async_token_handoff=off"])
    expected = roomy.generate(PROMPTS, [SamplingParams(max_tokens=MAX_LEN - len(p), ignore_eos=True)
                                        for p in PROMPTS])
    for prompt, out, reference in zip(PROMPTS, outputs, expected, strict=True):
        assert out.finish_reason == "length", f"prompt of {len(prompt)}: finished with {out.finish_reason} " \
            f"({out.error})"
        assert len(out.output_token_ids) == MAX_LEN - len(prompt)
        assert out.output_token_ids == reference.output_token_ids
    # The engine goes on serving after its requests hit the limit.
    again = engine.generate([PROMPTS[2]], UNBOUNDED)[0]
    assert again.output_token_ids == outputs[2].output_token_ids and again.finish_reason == "length"


def test_a_request_alone_at_the_limit_on_the_async_path(make_engine: EngineFactory) -> None:
    # Alone, nothing else in the batch hides a step scheduled past the limit.
    engine = make_engine([*NPU, f"model.max_model_len={MAX_LEN}", "engine.async_token_handoff=on"])
    [out] = engine.generate([PROMPTS[3]], UNBOUNDED)
    assert (out.finish_reason, len(out.output_token_ids)) == ("length", MAX_LEN - len(PROMPTS[3]))
