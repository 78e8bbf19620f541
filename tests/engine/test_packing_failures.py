"""A request that cannot be packed into a step fails alone: the requests beside it complete with the tokens they
get alone, and the engine keeps serving.

Packing is forced to fail for one request with the ``pack`` fault point (``pack@N`` fails the N-th request
packed: in the step of the prompts, or in a step of prompt chunks beside decode rows while another step is in
flight), or with a sampling
value the device's columns cannot hold, put on a request after it was checked (a value validation let through).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from corelib.engine import Engine, SamplingParams
from corelib.engine.packing import column_value
from corelib.ops.spec import SAMPLING_COLUMNS
from corelib.support import faults

ENGINE = ["backend=npu", "engine.async_token_handoff=on", "engine.max_num_seqs=4", "model.max_model_len=64"]
PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
GOOD = SamplingParams(max_tokens=6, ignore_eos=True)
COLUMN = {c.param: c for c in SAMPLING_COLUMNS}


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine.from_overrides(ENGINE) as shared:
        yield shared


@pytest.fixture(scope="module")
def alone(engine: Engine) -> list[list[int]]:
    return [o.output_token_ids for o in engine.generate(PROMPTS, GOOD)]


def assert_only_the_second_failed(engine: Engine, alone: list[list[int]], says: str) -> None:
    outputs = engine.generate(PROMPTS, GOOD)
    bad = outputs[1]
    assert bad.finish_reason == "error" and bad.error is not None, bad
    assert says in bad.error and "\n" not in bad.error, bad.error
    assert [outputs[0].output_token_ids, outputs[2].output_token_ids] == [alone[0], alone[2]]
    # The engine keeps serving: the same requests again give what they gave alone.
    assert [o.output_token_ids for o in engine.generate(PROMPTS, GOOD)] == alone


def test_a_packing_failure_in_the_prefill_fails_its_own_request_never_the_engine(
    engine: Engine, alone: list[list[int]]
) -> None:
    with faults.injected("pack@2"):  # the second request packed, in the step of all three prompts
        assert_only_the_second_failed(engine, alone, "request '")
    assert engine.stats().num_running == engine.stats().num_waiting == 0


def test_a_packing_failure_beside_decode_rows_with_a_step_in_flight_fails_its_own_request() -> None:
    # Chunks of at most 3 tokens: the first prompt fills step 0, and the second is first packed into
    # step 1 beside the first's decode row, scheduled ahead while step 0 is in flight. Taking step 1
    # back must leave the first request exactly as it was.
    overrides = [*ENGINE, "engine.chunked_prefill=on", "engine.max_num_batched_tokens=3"]
    with Engine.from_overrides(overrides) as chunked:
        alone = [o.output_token_ids for o in chunked.generate(PROMPTS, GOOD)]
        with faults.injected("pack@2"):
            assert_only_the_second_failed(chunked, alone, "request '")
        stats = chunked.stats()
        assert stats.num_running == stats.num_waiting == 0
        assert stats.kv_blocks_free == stats.kv_blocks_total, "a block of the step taken back was not returned"


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", 3.5e38), ("temperature", 1e308), ("top_p", float("inf")), ("top_k", 2**63), ("seed", -(2**63) - 1),
])
def test_a_value_the_columns_cannot_hold_fails_its_request_alone(
    engine: Engine, alone: list[list[int]], field: str, value: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Put the value on the second request after add_request checked it, as a value validation let through would be.
    add = Engine.add_request
    added: list[str] = []

    def add_request(self: Engine, prompt: object, sampling: SamplingParams | None = None, **kwargs: object) -> str:
        request_id = add(self, prompt, sampling, **kwargs)  # type: ignore[arg-type]
        added.append(request_id)
        if len(added) == 2:
            seq = next(s for s in self.scheduler.waiting if s.request_id == request_id)
            let_through = seq.sampling.replace()  # a copy, then the value SamplingParams would refuse
            object.__setattr__(let_through, field, value)
            seq.sampling = let_through
        return request_id

    monkeypatch.setattr(Engine, "add_request", add_request)
    outputs = engine.generate(PROMPTS, GOOD)
    monkeypatch.undo()
    bad = outputs[1]
    assert bad.finish_reason == "error" and bad.error is not None, bad
    assert f"sampling.{field}={value!r} does not fit the device's" in bad.error, bad.error
    assert [outputs[0].output_token_ids, outputs[2].output_token_ids] == [alone[0], alone[2]]
    assert [o.output_token_ids for o in engine.generate(PROMPTS, GOOD)] == alone


@pytest.mark.parametrize(("field", "value", "packed"), [
    ("temperature", np.float32(0.5), 0.5), ("top_p", np.float64(0.25), 0.25), ("top_k", np.int64(7), 7),
    ("seed", np.uint32(9), 9), ("temperature", 3.4e38, 3.4e38), ("top_k", 2**63 - 1, 2**63 - 1),
])
def test_numpy_scalars_and_the_largest_values_pack(field: str, value: object, packed: float) -> None:
    assert column_value(COLUMN[field], value) == packed
