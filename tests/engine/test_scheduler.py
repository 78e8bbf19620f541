"""Scheduling policy on the CPU, no device: admission, decode, stops, preemption, lookahead."""

from __future__ import annotations

from corelib.engine.block_manager import BlockManager
from corelib.engine.scheduler import NoStep, ScheduledStep, Scheduler, SchedulerLimits
from corelib.engine.sequence import FinishReason, SamplingParams, Sequence, Status
from corelib.engine.stops import StopChecker
from corelib.step.forward_input import StepKind

EOS = 1


def make(num_blocks: int = 64, block_size: int = 4, max_seqs: int = 4, max_len: int = 64) -> Scheduler:
    return Scheduler(SchedulerLimits(max_seqs, 64, max_len), BlockManager(num_blocks, block_size), max_seqs,
                     StopChecker(max_len, frozenset({EOS})))


def seq(i: int, prompt_len: int = 5, max_tokens: int = 8, **kw: object) -> Sequence:
    return Sequence(i, f"r{i}", list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens, **kw))  # type: ignore[arg-type]


def no_sync(_: list[Sequence]) -> list[str]:
    return []


def step(s: Scheduler, in_flight: bool = False) -> ScheduledStep:
    out = s.schedule(in_flight=in_flight, sync_check=no_sync)
    assert isinstance(out, ScheduledStep), f"expected a step, got {out!r}"
    return out


def test_prefill_first_then_decode_fifo() -> None:
    s = make()
    for i in range(3):
        s.add(seq(i))
    first = step(s)
    assert first.kind is StepKind.prefill and [q.seq_id for q in first.seqs] == [0, 1, 2]
    s.postprocess(first, [5, 6, 7])
    second = step(s)
    assert second.kind is StepKind.decode
    assert second.positions == [5, 5, 5] and second.from_relay == [False] * 3


def test_stops_on_eos_max_tokens_and_stop_ids() -> None:
    s = make()
    a, b, c = seq(0, max_tokens=5), seq(1, max_tokens=1), seq(2, stop_token_ids=(42,))
    for q in (a, b, c):
        s.add(q)
    prefill = step(s)
    finished = s.postprocess(prefill, [EOS, 3, 42])
    assert {q.seq_id for q in finished} == {0, 1, 2}
    assert a.finish_reason is FinishReason.stop and b.finish_reason is FinishReason.length
    assert c.finish_reason is FinishReason.stop
    assert s.blocks.num_free_blocks == 63 and not s.running


def test_ignore_eos_keeps_going() -> None:
    s = make()
    a = seq(0, ignore_eos=True)
    s.add(a)
    s.postprocess(step(s), [EOS])
    assert not a.is_finished


def test_admission_waits_for_free_blocks() -> None:
    s = make(num_blocks=4, block_size=4)  # 3 usable blocks = 12 tokens
    s.add(seq(0, prompt_len=8))
    s.add(seq(1, prompt_len=8))
    first = step(s)
    assert [q.seq_id for q in first.seqs] == [0]


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    s = make(num_blocks=5, block_size=4, max_len=32)  # 4 usable blocks
    a, b = seq(0, prompt_len=4, max_tokens=20), seq(1, prompt_len=4, max_tokens=20)
    s.add(a)
    s.add(b)
    s.postprocess(step(s), [20, 21])
    for token in range(30, 40):
        decode = step(s)
        if decode.num_preempted:
            break
        s.postprocess(decode, [token] * len(decode.seqs))
    assert s.num_preemptions >= 1
    assert b.status is Status.WAITING and s.waiting[0] is b and b.block_table == []
    assert b.output_token_ids  # generated tokens survive the preemption and are recomputed


def test_lookahead_schedules_from_relay_and_drops_token_after_stop() -> None:
    s = make()
    a = seq(0, max_tokens=10)
    s.add(a)
    prefill = step(s)
    decode1 = step(s, in_flight=True)  # prefill tokens not seen yet
    assert decode1.from_relay == [True] and decode1.positions == [5]
    assert a.num_pending == 2
    s.postprocess(prefill, [EOS])  # stops; decode1 is still in flight
    assert a.is_finished and a.block_table == [] and a.state_index is None
    s.postprocess(decode1, [99])
    assert a.output_token_ids == [EOS]  # the token sampled past the stop is dropped


def test_max_tokens_one_never_scheduled_past_its_stop() -> None:
    s = make()
    a = seq(0, max_tokens=1)
    s.add(a)
    prefill = step(s)
    assert s.schedule(in_flight=True, sync_check=no_sync) is NoStep.drain
    s.postprocess(prefill, [7])
    assert a.output_token_ids == [7] and a.finish_reason is FinishReason.length


def test_sync_check_forces_drain_while_in_flight() -> None:
    s = make()
    a = seq(0, max_tokens=10)
    s.add(a)
    prefill = step(s)

    def blocker(seqs: list[Sequence]) -> list[str]:
        return ["host-side stop strings"]

    assert s.schedule(in_flight=True, sync_check=blocker) is NoStep.drain
    s.postprocess(prefill, [3])
    out = s.schedule(in_flight=False, sync_check=blocker)
    assert isinstance(out, ScheduledStep) and out.synchronous and out.sync_reasons == ["host-side stop strings"]
