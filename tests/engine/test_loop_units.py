"""The request loop's parts, each on its own on the CPU in milliseconds: no model.

EngineCore runs around the scripted executor of :mod:`corelib.testing.executor` (no device);
the packer and the step pipeline are exercised directly, the token handoff on an emulated device.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from corelib.engine.packing import InputBuilder
from corelib.engine.scheduler import ScheduledStep
from corelib.engine.sequence import FinishReason, SamplingParams, Sequence
from corelib.ops.composed import publish_checked
from corelib.ops.reference import reference_ops
from corelib.ops.spec import SAMPLING_COLUMNS
from corelib.platform.backend import DeviceSpec
from corelib.platform.device import Capabilities, Runtime
from corelib.platform.emulator import EmulatedDevice
from corelib.step.arena import RELAY
from corelib.step.forward_input import StepKind
from corelib.step.handoff import StepHandle, TokenHandoff
from corelib.step.layout import EngineLayout
from corelib.step.pipeline import StepPipeline
from corelib.testing.executor import scripted_core, unit_config, unit_options

Log = list[tuple[str, int]]


def run_all(prompts: list[list[int]], run_ahead: int, max_tokens: int = 6) -> tuple[dict[str, list[int]], Log]:
    core, executor = scripted_core(options=unit_options(run_ahead=run_ahead))
    for number, prompt in enumerate(prompts):
        core.scheduler.add(Sequence(number, f"r{number}", prompt, SamplingParams(max_tokens=max_tokens)))
    outputs: dict[str, list[int]] = {}
    while core.iterate():
        outputs.update((s.request_id, s.output_token_ids) for s in core.take_finished())
    outputs.update((s.request_id, s.output_token_ids) for s in core.take_finished())
    return outputs, executor.log


# ------------------------------------------------------------------------------------- EngineCore
def test_the_synchronous_loop_reads_each_step_before_it_submits_the_next() -> None:
    outputs, log = run_all([[5, 6, 7], [9, 10]], run_ahead=0)
    assert outputs == {"r0": [8, 9, 10, 11, 12, 13], "r1": [11, 12, 13, 14, 15, 16]}
    kinds = [kind for kind, _ in log if kind != "release"]
    assert kinds == ["submit", "result"] * (len(kinds) // 2), "a step was submitted before the last one was read"


def test_the_async_loop_runs_one_step_ahead_and_gets_the_same_tokens() -> None:
    synchronous, _ = run_all([[5, 6, 7], [9, 10]], run_ahead=0)
    ahead, log = run_all([[5, 6, 7], [9, 10]], run_ahead=1)
    assert ahead == synchronous
    submitted = [step for kind, step in log if kind == "submit"]
    read = [step for kind, step in log if kind == "result"]
    assert read == submitted, "results must be read in submission order"
    # Step 1 (the first decode) goes out before step 0's tokens are read: one step ahead, never two.
    assert log.index(("submit", 1)) < log.index(("result", 0))
    for step in submitted[2:]:
        assert log.index(("result", step - 2)) < log.index(("submit", step)), f"step {step} ran two ahead"


def test_a_row_whose_token_is_still_on_the_device_is_fed_from_the_relay() -> None:
    core, executor = scripted_core(options=unit_options(run_ahead=1))
    core.scheduler.add(Sequence(0, "r0", [5, 6, 7], SamplingParams(max_tokens=4)))
    while core.iterate():
        pass
    prefill, first_decode, *rest = executor.submitted
    assert prefill.fi.kind is StepKind.prefill and first_decode.fi.kind is StepKind.decode
    assert int(first_decode.views["input_ids"][0]) == RELAY, "the prefill's token was not read yet when it ran"
    assert [int(s.views["positions"][0]) for s in (first_decode, *rest)] == [3, 4, 5]


def test_inputs_go_back_to_the_pool_only_after_the_step_is_read() -> None:
    for run_ahead in (0, 1):
        _, log = run_all([[5, 6, 7], [9, 10], [11]], run_ahead=run_ahead)
        for kind, step in log:
            if kind == "release":
                assert log.index(("result", step)) < log.index(("release", step)), f"step {step} released early"
        assert sum(kind == "release" for kind, _ in log) == sum(kind == "submit" for kind, _ in log)


def test_finish_ends_a_running_request_at_once_and_returns_its_blocks() -> None:
    core, _ = scripted_core(options=unit_options(run_ahead=1))
    seq = Sequence(0, "r0", [5, 6, 7], SamplingParams(max_tokens=50))
    other = Sequence(1, "r1", [8, 9], SamplingParams(max_tokens=3))
    core.scheduler.add(seq)
    core.scheduler.add(other)
    free = core.scheduler.blocks.num_free_blocks
    core.iterate()
    core.iterate()
    core.finish(seq, FinishReason.abort)
    assert [s.request_id for s in core.take_finished()] == ["r0"] and seq.finish_reason is FinishReason.abort
    while core.iterate():
        pass
    assert [s.request_id for s in core.take_finished()] == ["r1"]
    assert core.scheduler.blocks.num_free_blocks == free, "a finished request kept KV blocks"
    assert len(seq.output_token_ids) <= 2, "tokens sampled after the abort reached the request"


def test_finish_all_ends_waiting_and_running_requests_with_the_reason() -> None:
    core, _ = scripted_core()
    for number in range(3):
        core.scheduler.add(Sequence(number, f"r{number}", [5, 6], SamplingParams(max_tokens=8)))
    core.iterate()
    core.finish_all(FinishReason.error, "the device went away")
    ended = core.take_finished()
    assert sorted(s.request_id for s in ended) == ["r0", "r1", "r2"]
    assert all(s.finish_reason is FinishReason.error and s.error == "the device went away" for s in ended)
    assert not core.scheduler.has_unfinished


def test_stats_counts_steps_requests_and_blocks() -> None:
    core, _ = scripted_core(unit_config(max_num_seqs=2), unit_options(run_ahead=1))
    for number in range(3):
        core.scheduler.add(Sequence(number, f"r{number}", [5, 6], SamplingParams(max_tokens=4)))
    before = core.stats()
    assert (before.num_steps, before.num_waiting, before.num_running) == (0, 3, 0)
    core.iterate()
    core.iterate()
    during = core.stats(since_step=0)
    assert during.num_running == 2 and during.num_waiting == 1 and during.num_in_flight == 1
    assert during.kv_blocks_free < during.kv_blocks_total and during.num_steps == len(during.steps) == 1
    while core.iterate():
        pass
    after = core.stats()
    assert after.kv_blocks_free == after.kv_blocks_total and after.num_running == after.num_waiting == 0


# ----------------------------------------------------------------------------------- StepPipeline
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_the_pipeline_holds_depth_steps_and_asks_for_a_read_beyond_run_ahead(depth: int) -> None:
    pipeline: StepPipeline[int] = StepPipeline(depth)
    assert pipeline.run_ahead == depth - 1
    for step in range(depth):
        assert pipeline.can_submit()
        pipeline.push(step)
        assert pipeline.must_read() == (step + 1 > depth - 1)
    assert not pipeline.can_submit()
    with pytest.raises(RuntimeError, match="full"):
        pipeline.push(depth)
    assert [pipeline.pop() for _ in range(depth)] == list(range(depth)), "steps are read oldest first"


def test_a_pipeline_needs_room_for_one_step() -> None:
    with pytest.raises(ValueError, match="at least one"):
        StepPipeline(0)


# ----------------------------------------------------------------------------------- InputBuilder
def _decode_step(seqs: list[Sequence], from_relay: list[bool]) -> ScheduledStep:
    return ScheduledStep(seqs, [s.num_tokens - 1 for s in seqs], [1] * len(seqs), [True] * len(seqs), from_relay)


def _builder(max_rows: int, max_blocks: int, block_size: int) -> InputBuilder:
    return InputBuilder(EngineLayout.of(unit_config(max_num_seqs=max_rows, block_size=block_size,
                                                    max_model_len=max_blocks * block_size)))


def test_packing_a_decode_step_writes_each_row_and_pads_the_rest() -> None:
    builder = _builder(4, 8, 4)
    hot = SamplingParams(temperature=0.5, top_k=3, seed=11)
    a = Sequence(0, "a", [5, 6, 7, 8, 9], hot, block_table=[3, 7], state_index=2)
    b = Sequence(1, "b", [4], SamplingParams(), block_table=[5], state_index=0)
    b.output_token_ids.append(12)
    arena = torch.zeros(builder.decode.nbytes, dtype=torch.uint8)
    fi = builder.fill(9, _decode_step([a, b], [False, True]), arena, bucket=4, kv_blocks=2)
    v = fi.views()
    assert fi.step_id == 9 and fi.num_seqs == 2 and fi.bucket == 4 and fi.sample, "row a samples"
    assert v["input_ids"][:2].tolist() == [9, RELAY]
    assert v["positions"][:2].tolist() == [4, 1] and v["seq_lens"][:2].tolist() == [5, 2]
    assert v["slot_mapping"][:2].tolist() == [7 * 4 + 0, 5 * 4 + 1], "position 4 lies in a's second block"
    assert v["state_indices"][:4].tolist() == [2, 0, 4, 4], "padded rows use the pad slot"
    assert v["block_tables"][:2, :2].tolist() == [[3, 7], [5, 0]]
    by_name = {c.name: c for c in SAMPLING_COLUMNS}
    assert v["temperature"][:2].tolist() == [0.5, by_name["temperature"].neutral]
    assert v["top_k"][0].item() == 3 and v["seeds"][0].item() == 11
    assert v["input_ids"][2:4].tolist() == [0, 0] and v["seq_lens"][2:4].tolist() == [1, 1]


def test_a_slot_taken_by_another_request_gets_its_blocks_and_sampling_anew() -> None:
    builder = _builder(2, 4, 4)
    arena = torch.zeros(builder.decode.nbytes, dtype=torch.uint8)
    first = Sequence(0, "a", [1, 2, 3], SamplingParams(temperature=0.7), block_table=[3], state_index=0)
    builder.fill(0, _decode_step([first], [False]), arena, bucket=1, kv_blocks=1)
    second = Sequence(1, "b", [4, 5], SamplingParams(), block_table=[6], state_index=0)
    fi = builder.fill(1, _decode_step([second], [False]), arena, bucket=1, kv_blocks=1)
    v = fi.views()
    assert v["block_tables"][0, 0].item() == 6 and not fi.sample
    assert v["temperature"][0].item() == 0.0, "the slot kept the previous owner's temperature"


def test_a_block_table_that_grows_or_is_dropped_is_packed_anew() -> None:
    builder = _builder(1, 4, 2)
    arena = torch.zeros(builder.decode.nbytes, dtype=torch.uint8)
    seq = Sequence(0, "a", [1, 2], SamplingParams(), block_table=[3], state_index=0)
    builder.fill(0, _decode_step([seq], [False]), arena, bucket=1, kv_blocks=1)
    seq.output_token_ids.append(9)
    seq.block_table.append(5)
    assert builder.fill(1, _decode_step([seq], [False]), arena, 1, 2).views()["block_tables"][0, :2].tolist() == [3, 5]
    seq.block_table[:] = [7, 8]  # recomputed after a preemption: new blocks, new epoch
    seq.blocks_epoch += 1
    assert builder.fill(2, _decode_step([seq], [False]), arena, 1, 2).views()["block_tables"][0, :2].tolist() == [7, 8]


def test_a_batch_samples_when_any_row_does_not_only_the_first() -> None:
    builder = _builder(2, 2, 4)
    arena = torch.zeros(builder.decode.nbytes, dtype=torch.uint8)
    greedy = Sequence(0, "g", [1, 2], SamplingParams(), block_table=[1], state_index=0)
    hot = Sequence(1, "h", [3, 4], SamplingParams(temperature=1.0), block_table=[2], state_index=1)
    assert builder.fill(0, _decode_step([greedy, hot], [False, False]), arena, 2, 1).sample
    assert not builder.fill(1, _decode_step([greedy], [False]), arena, 1, 1).sample


# ----------------------------------------------------------------------------------- TokenHandoff
@pytest.fixture
def device() -> Iterator[EmulatedDevice]:
    capabilities = Capabilities(streams=True, events=True, event_query=True, event_timing=True, blocking_sync=True,
                                pinned_host=True, async_d2h=True, pageable_h2d_is_staged=False)
    opened = EmulatedDevice(DeviceSpec("npu", Runtime.emulated, capabilities, timeout_s=5.0))
    yield opened
    opened.close()


def _step(handoff: TokenHandoff, step_id: int, tokens: list[int], slots: list[int]) -> StepHandle:
    """One step as the runner does it: publish the samples, then hand them to the host."""
    buffer, timing = handoff.begin(step_id)
    sources = torch.tensor(tokens), torch.tensor(slots)  # host memory the copies read: alive until read
    sampled = handoff.device.empty((len(tokens),), torch.int64)
    slot_ids = handoff.device.empty((len(slots),), torch.int64)
    handoff.compute.copy(sampled, sources[0])
    handoff.compute.copy(slot_ids, sources[1])
    handoff.compute.launch(lambda: publish_checked(sampled, sampled >= 0, *handoff.publish_targets(len(tokens)),
                                                   slot_ids))
    event = handoff.emit(buffer, len(tokens), timing)
    return StepHandle(step_id, StepKind.decode, len(tokens), buffer, event, timing, False,
                      (sampled, slot_ids, *sources))


def test_the_handoff_gives_each_step_its_tokens_and_keeps_the_latest_per_slot(device: EmulatedDevice) -> None:
    handoff = TokenHandoff(device, device.stream("compute"), rows=4, num_states=4, depth=2, timing=True)
    first = _step(handoff, 0, [11, 12], [0, 3])
    second = _step(handoff, 1, [21], [3])
    assert handoff.read(first, 5.0).tokens == [11, 12]
    assert handoff.read(second, 5.0).tokens == [21]
    host_inputs, host_slots, host_kv_slots = torch.tensor([RELAY, 7, RELAY]), torch.tensor([3, 1, 0]), torch.tensor(
        [5, 0, 2])
    inputs = device.empty((3,), torch.int64)
    slots = device.empty((3,), torch.int64)
    handoff.compute.copy(inputs, host_inputs)
    handoff.compute.copy(slots, host_slots)
    resolved = device.empty((3,), torch.int64)
    fed = device.zeros((8,), torch.int64)  # the tokens fed at each KV slot
    kv_slots = device.empty((3,), torch.int64)
    handoff.compute.copy(kv_slots, host_kv_slots)
    relay_inputs = reference_ops().relay_inputs
    handoff.compute.launch(lambda: resolved.copy_(relay_inputs(inputs, handoff.seq_tokens, slots, fed, kv_slots)))
    handoff.compute.synchronize()
    assert resolved.tolist() == [21, 7, 11], "relay rows read their slot's latest sample, the others their id"
    assert fed.tolist() == [7, 0, 11, 0, 0, 21, 0, 0], "each fed token lands at its KV slot"


def test_a_token_buffer_is_not_reused_before_its_tokens_are_read(device: EmulatedDevice) -> None:
    handoff = TokenHandoff(device, device.stream("compute"), rows=2, num_states=2, depth=1, timing=False)
    first = _step(handoff, 0, [5], [0])
    with pytest.raises(RuntimeError, match="reused before the tokens"):
        handoff.begin(1)
    assert handoff.read(first, 5.0).tokens == [5]
    assert handoff.read(_step(handoff, 1, [6], [1]), 5.0).tokens == [6]
