"""Run metrics: per-step device spans from events, per-request latencies from host clocks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from corelib.device import Event
from corelib.engine.runner import StepHandle
from corelib.engine.scheduler import StepKind
from corelib.engine.sequence import FinishReason, Sequence


@dataclass(frozen=True)
class StepRecord:
    step_id: int
    kind: StepKind
    path: str  # sync or async
    num_seqs: int
    busy_ms: float | None  # device time of the step (events)
    gap_ms: float | None  # device idle time since the previous step ended (events)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


class MetricsCollector:
    """Collects step records as steps complete; summarises them at the end."""

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []
        self.sync_reasons: Counter[str] = Counter()
        self._prev_end: Event | None = None

    def record(self, handle: StepHandle, path: str, sync_reasons: Iterable[str]) -> None:
        timing = handle.timing
        busy = gap = None
        if timing.start is not None and timing.end is not None:
            busy = timing.start.elapsed_ms(timing.end)
            if self._prev_end is not None:
                gap = max(0.0, self._prev_end.elapsed_ms(timing.start))
        self.steps.append(StepRecord(handle.step_id, handle.kind, path, handle.num_seqs, busy, gap))
        self.sync_reasons.update(sync_reasons)
        self._prev_end = timing.end

    def device_summary(self, first_step: int = 0) -> dict[str, Any]:
        """Occupancy and idle gaps over consecutive decode steps (steady decode) from ``first_step`` on."""
        busy = gaps = 0.0
        gap_list: list[float] = []
        previous: StepRecord | None = None
        for record in self.steps[first_step:]:
            if record.kind is StepKind.decode and record.busy_ms is not None:
                busy += record.busy_ms
                if previous is not None and previous.kind is StepKind.decode and record.gap_ms is not None:
                    gaps += record.gap_ms
                    gap_list.append(record.gap_ms)
            previous = record
        occupancy = busy / (busy + gaps) if busy + gaps > 0 else None
        gap_median = percentile(gap_list, 50)
        return {
            "occupancy": occupancy,
            "decode_busy_ms": busy,
            "decode_idle_ms": gaps,
            "idle_gap_median_us": gap_median * 1e3 if gap_median is not None else None,
            "idle_gap_p99_us": (percentile(gap_list, 99) or 0.0) * 1e3 if gap_list else None,
        }

    def summary(self, seqs: Iterable[Sequence], wall_s: float) -> dict[str, Any]:
        done = list(seqs)
        ttft = [
            (s.first_token_time - s.arrival_time) * 1e3
            for s in done
            if s.first_token_time is not None
        ]
        tpot = [
            (s.finish_time - s.first_token_time) * 1e3 / (len(s.output_token_ids) - 1)
            for s in done
            if s.finish_time is not None and s.first_token_time is not None and len(s.output_token_ids) > 1
        ]
        output_tokens = sum(len(s.output_token_ids) for s in done)
        paths = Counter(r.path for r in self.steps)
        kinds = Counter(r.kind.value for r in self.steps)
        reasons = Counter(s.finish_reason.value if s.finish_reason else "unfinished" for s in done)
        return {
            "requests": len(done),
            "requests_failed": reasons.get(FinishReason.error.value, 0),
            "finish_reasons": dict(reasons),
            "prompt_tokens": sum(len(s.prompt_token_ids) for s in done),
            "output_tokens": output_tokens,
            "wall_s": wall_s,
            "tokens_per_s": output_tokens / wall_s if wall_s > 0 else None,
            "ttft_ms_p50": percentile(ttft, 50),
            "ttft_ms_p99": percentile(ttft, 99),
            "tpot_ms_p50": percentile(tpot, 50),
            "tpot_ms_p99": percentile(tpot, 99),
            "steps": len(self.steps),
            "steps_prefill": kinds.get(StepKind.prefill.value, 0),
            "steps_decode": kinds.get(StepKind.decode.value, 0),
            "steps_sync": paths.get("sync", 0),
            "steps_async": paths.get("async", 0),
            "sync_step_reasons": dict(self.sync_reasons),
            **self.device_summary(),
        }
