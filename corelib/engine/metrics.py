"""Run metrics: per-step device spans from events, per-request latencies from host clocks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from corelib.engine.scheduler import StepKind

if TYPE_CHECKING:
    from corelib.engine.runner import StepHandle
from corelib.engine.sequence import FinishReason, Sequence


@dataclass(frozen=True)
class StepResult:
    """What comes back for one step, from this process's device or from a worker."""

    step_id: int
    kind: StepKind
    tokens: list[int]
    busy_ms: float | None = None  # device time of the step (events)
    gap_ms: float | None = None  # device idle time since the previous step ended (events)
    graph: bool = False  # a decode step that replayed a captured graph
    transport_us: float | None = None  # SHM: producer commit to inputs ready in the worker
    handle: StepHandle | None = None  # in-process steps: the handle, whose events a tracer reads


@dataclass(frozen=True)
class StepRecord:
    step_id: int
    kind: StepKind
    path: str  # sync or async
    num_seqs: int
    busy_ms: float | None
    gap_ms: float | None
    graph: bool
    transport_us: float | None


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

    def record(self, result: StepResult, path: str, sync_reasons: Iterable[str]) -> None:
        self.steps.append(
            StepRecord(result.step_id, result.kind, path, len(result.tokens), result.busy_ms, result.gap_ms,
                       result.graph, result.transport_us)
        )
        self.sync_reasons.update(sync_reasons)

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
        transport = [r.transport_us for r in self.steps if r.transport_us is not None]
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
            "graph_steps": sum(1 for r in self.steps if r.graph),
            "eager_steps": sum(1 for r in self.steps if r.kind is StepKind.decode and not r.graph),
            "transport_us_p50": percentile(transport, 50),
            "transport_us_p99": percentile(transport, 99),
            "sync_step_reasons": dict(self.sync_reasons),
            **self.device_summary(),
        }
