"""A step samples when any of its rows does: decided from every row, in process and over SHM."""

from __future__ import annotations

import pytest
import torch
from ringkit import wire

from corelib.engine.block_manager import BlockManager
from corelib.engine.packing import InputBuilder
from corelib.engine.scheduler import ScheduledStep, Scheduler, SchedulerLimits
from corelib.engine.sequence import SamplingParams, Sequence
from corelib.engine.stops import StopChecker
from corelib.step.forward_input import ForwardInput, StepKind
from corelib.step.layout import EngineLayout
from corelib.testing.executor import unit_config
from corelib.transport.wire import input_header, input_of

ROWS, MAX_BLOCKS, BLOCK = 4, 4, 4
GREEDY, SAMPLED = SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=0.8, seed=1)


def scheduled(*sampling: SamplingParams) -> tuple[ScheduledStep, ScheduledStep]:
    """The prefill and the first decode step of one request per ``sampling``, in that order."""
    scheduler = Scheduler(SchedulerLimits(ROWS, 64, 16), BlockManager(16, BLOCK), ROWS, StopChecker(16, frozenset()))
    for i, params in enumerate(sampling):
        scheduler.add(Sequence(i, f"r{i}", [5 + i, 6, 7], params))
    prefill = scheduler.schedule(in_flight=False, sync_check=lambda seqs: [])
    assert isinstance(prefill, ScheduledStep)
    scheduler.postprocess(prefill, [9] * len(sampling))
    decode = scheduler.schedule(in_flight=False, sync_check=lambda seqs: [])
    assert isinstance(decode, ScheduledStep) and decode.kind is StepKind.decode
    return prefill, decode


def packed(step: ScheduledStep) -> ForwardInput:
    builder = InputBuilder(EngineLayout.of(unit_config(max_num_seqs=ROWS, block_size=BLOCK, max_model_len=16)))
    arena = torch.zeros(1 << 16, dtype=torch.uint8)
    return builder.fill(0, step, arena, ROWS if step.kind is StepKind.decode else len(step.seqs), 1)


@pytest.mark.parametrize("order", ["greedy-first", "sampled-first"])
def test_a_batch_samples_when_any_row_does(order: str) -> None:
    rows = (GREEDY, SAMPLED) if order == "greedy-first" else (SAMPLED, GREEDY)
    for step in scheduled(*rows):
        assert packed(step).sample, step.kind


def test_an_all_greedy_batch_takes_the_greedy_path() -> None:
    for step in scheduled(GREEDY, GREEDY):
        assert not packed(step).sample, step.kind


def test_over_shm_the_worker_sees_the_batch_sample_from_its_second_row() -> None:
    w = wire(slot_bytes=1 << 16)
    try:
        for step in scheduled(GREEDY, SAMPLED):
            fi = packed(step)
            w.producer.write(input_header(fi, sent_at=0.0), fi.arena[: fi.layout.nbytes])
            frame = w.consumers[0].read()
            received = input_of(frame.header, frame.payload, "test frame")
            assert received.sample and received.kind is fi.kind and received.num_seqs == 2
            w.consumers[0].release(frame)
    finally:
        w.close()


BIASED = SamplingParams(max_tokens=8, logit_bias={3: 2.0})


def test_a_step_draws_only_where_a_row_has_a_temperature() -> None:
    for step in scheduled(GREEDY, BIASED):
        fi = packed(step)
        assert fi.sample and not fi.draws, step.kind
    for step in scheduled(BIASED, SAMPLED):
        fi = packed(step)
        assert fi.sample and fi.draws, step.kind


@pytest.mark.parametrize("rows", [(GREEDY, BIASED), (BIASED, SAMPLED)])
def test_over_shm_the_worker_sees_whether_the_step_draws(rows: tuple[SamplingParams, SamplingParams]) -> None:
    w = wire(slot_bytes=1 << 16)
    try:
        for step in scheduled(*rows):
            fi = packed(step)
            w.producer.write(input_header(fi, sent_at=0.0), fi.arena[: fi.layout.nbytes])
            frame = w.consumers[0].read()
            received = input_of(frame.header, frame.payload, "test frame")
            assert received.sample and received.draws == fi.draws == (SAMPLED in rows)
            w.consumers[0].release(frame)
    finally:
        w.close()


CUT = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=1)


@pytest.mark.parametrize(("rows", "cuts"), [
    ((GREEDY, SAMPLED), False),
    ((SAMPLED, SamplingParams(max_tokens=8, temperature=1.0, seed=3)), False),
    ((SAMPLED, CUT), True),
    ((SamplingParams(max_tokens=8, temperature=0.5, top_k=5), GREEDY), True),
    ((SamplingParams(max_tokens=8, temperature=0.5, min_p=0.1), GREEDY), True),
])
def test_a_drawing_step_sorts_only_where_a_row_has_a_cut(rows: tuple[SamplingParams, SamplingParams],
                                                          cuts: bool) -> None:
    w = wire(slot_bytes=1 << 16)
    try:
        for step in scheduled(*rows):
            fi = packed(step)
            assert fi.draws and fi.cuts == cuts, step.kind
            w.producer.write(input_header(fi, sent_at=0.0), fi.arena[: fi.layout.nbytes])
            frame = w.consumers[0].read()
            received = input_of(frame.header, frame.payload, "test frame")
            assert received.draws and received.cuts == cuts, step.kind
            w.consumers[0].release(frame)
    finally:
        w.close()


def test_a_step_that_does_not_draw_has_nothing_to_cut() -> None:
    for step in scheduled(SamplingParams(max_tokens=8, top_p=0.5, top_k=3), BIASED):
        fi = packed(step)
        assert fi.sample and not fi.draws and not fi.cuts, step.kind
