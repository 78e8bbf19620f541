"""The metrics collector: exact totals over the whole run, bounded windows for percentiles and spans."""

from __future__ import annotations

import gc

from corelib.engine.sequence import FinishReason, SamplingParams, Sequence
from corelib.observe.metrics import MetricsCollector
from corelib.step.forward_input import StepKind
from corelib.step.handoff import StepResult
from corelib.support.stats import percentile


def finished(index: int, outputs: int, reason: FinishReason = FinishReason.length) -> Sequence:
    seq = Sequence(index, str(index), [1, 2, 3], SamplingParams(max_tokens=outputs), arrival_time=0.0)
    seq.output_token_ids = list(range(outputs))
    seq.first_token_time = 0.001 * (index + 1)  # ttft of request i: i + 1 ms
    seq.finish_time = seq.first_token_time + 0.002 * (outputs - 1)  # 2 ms per later token
    seq.finish_reason = reason
    return seq


def decode(step_id: int, graph: bool = True) -> StepResult:
    return StepResult(step_id, StepKind.decode, [0, 0], busy_ms=1.0, gap_ms=0.5, graph=graph)


def test_totals_are_exact_while_held_steps_and_requests_stay_bounded() -> None:
    metrics = MetricsCollector(window=10)
    for step in range(95):
        path = "async" if step % 2 else "sync"
        metrics.record(decode(step, graph=step % 5 != 0), path, ["stop strings"] * (step < 3))
    for index in range(40):
        metrics.finish(finished(index, 4, FinishReason.stop if index % 4 == 0 else FinishReason.length))

    assert 10 <= len(metrics.steps_since(0)) < 20, "the step window is between one and two windows long"
    assert metrics.num_steps == 95
    assert [r.step_id for r in metrics.steps_since(90)] == list(range(90, 95))
    assert metrics.steps_since(0)[0].step_id == metrics.steps_dropped, "older steps are gone, not misnumbered"

    summary = metrics.summary([], wall_s=2.0)
    assert summary["requests"] == 40
    assert summary["finish_reasons"] == {"stop": 10, "length": 30}
    assert summary["output_tokens"] == 160 and summary["prompt_tokens"] == 120
    assert summary["tokens_per_s"] == 80.0
    counts = (summary["steps"], summary["steps_decode"], summary["steps_sync"], summary["steps_async"])
    assert counts == (95, 95, 48, 47)
    assert (summary["graph_steps"], summary["eager_steps"]) == (76, 19)
    assert summary["sync_step_reasons"] == {"stop strings": 3}
    # Percentiles come from the latest 10 requests (30..39): ttft 31..40 ms.
    assert summary["ttft_ms_p50"] is not None and 31.0 <= summary["ttft_ms_p50"] <= 40.0
    assert summary["tpot_ms_p50"] is not None and abs(summary["tpot_ms_p50"] - 2.0) < 1e-9


def test_requests_still_held_by_the_engine_count_too() -> None:
    metrics = MetricsCollector(window=10)
    metrics.finish(finished(0, 3))
    running = finished(1, 2)
    running.finish_reason, running.finish_time = None, None
    summary = metrics.summary([running], wall_s=1.0)
    assert summary["requests"] == 2
    assert summary["finish_reasons"] == {"length": 1, "unfinished": 1}
    assert summary["output_tokens"] == 5


def test_memory_is_bounded_however_long_it_runs() -> None:
    metrics = MetricsCollector(window=100)
    for step in range(5000):
        metrics.record(decode(step), "async", [])
        metrics.finish(finished(step, 2))
    assert len(metrics.steps_since(0)) < 200
    assert len(metrics._ttft) == len(metrics._tpot) == 100
    assert metrics.summary([], 1.0)["requests"] == 5000


def test_the_step_window_leaves_nothing_for_the_garbage_collector_to_walk() -> None:
    # A full collection walks every object it tracks, between two steps: a window of 10-20 k records that it
    # tracked cost 4-12 ms a pass on the H200's host. The window's steps are kept as plain tuples, which leave
    # the collector's lists once a pass has seen them.
    from corelib.observe.metrics import HostTime

    metrics = MetricsCollector(window=1000)
    gc.collect()
    before = len(gc.get_objects())
    for step in range(1500):
        metrics.record(decode(step), "async", [], HostTime(10.0, 20.0, 5.0), num_tokens=2)
    gc.collect()
    gc.collect()
    assert len(gc.get_objects()) - before < 100, "the window's steps are tracked by the collector"
    record = metrics.steps_since(1499)[0]
    assert (record.step_id, record.kind, record.host, record.num_tokens) == (1499, StepKind.decode,
                                                                          HostTime(10.0, 20.0, 5.0), 2)


def test_a_percentile_is_a_value_measured_at_its_nearest_rank() -> None:
    hops = [float(value) for value in range(128, 0, -1)]  # 128 hops, unordered: the bench's p99 of a point
    assert percentile(hops, 99) == 127.0  # the second slowest, not a value between two measured
    assert percentile(hops, 50) == 65.0  # rank round(0.5 * 127) = 64 of 0..127
    assert (percentile(hops, 0), percentile(hops, 100)) == (1.0, 128.0)
    assert percentile(iter([3.0]), 99) == 3.0
    assert percentile([], 50) is None
