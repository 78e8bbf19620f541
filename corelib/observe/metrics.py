"""Run metrics: per-step device spans from events, per-request latencies from host clocks.

Counts and token totals cover the whole life of the engine. Percentiles and device spans
cover the latest ``engine.metrics_window`` requests and steps (every one, for a run shorter
than that), so an engine that serves for days holds the same memory as one that served for
minutes.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from corelib.sampling_params import FinishReason
from corelib.step.forward_input import StepKind
from corelib.step.handoff import StepResult

if TYPE_CHECKING:
    from corelib.engine.sequence import Sequence


@dataclass(frozen=True)
class HostTime:
    """The scheduler side's own work for one step, in µs: what the host adds to every step."""

    schedule_us: float  # choosing the batch (and its KV blocks)
    pack_us: float  # writing it into its arena
    postprocess_us: float  # taking its tokens: stop checks, finished requests

    @property
    def total_us(self) -> float:
        return self.schedule_us + self.pack_us + self.postprocess_us


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
    host: HostTime | None = None  # schedule + pack + post-process of this step on the scheduler side
    num_tokens: int = 0  # tokens the step fed (its rows' queries, before any padding)


WINDOW = 10_000  # requests and steps kept for percentiles and device spans


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


class MetricsCollector:
    """Collects step records as steps complete and request figures as requests are handed back."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self.steps: list[StepRecord] = []  # the latest steps: between window and 2 * window of them
        self.steps_dropped = 0  # older steps, counted in the totals only
        self.sync_reasons: Counter[str] = Counter()
        self._step_kinds: Counter[str] = Counter()
        self._step_paths: Counter[str] = Counter()
        self._graph_steps = 0
        self._eager_steps = 0
        self._reasons: Counter[str] = Counter()
        self._prompt_tokens = 0
        self._output_tokens = 0
        self._ttft: deque[float] = deque(maxlen=window)
        self._tpot: deque[float] = deque(maxlen=window)

    @property
    def num_steps(self) -> int:
        """Steps recorded since the engine started; a ``first_step`` for :meth:`steps_since`."""
        return self.steps_dropped + len(self.steps)

    def steps_since(self, first_step: int) -> list[StepRecord]:
        """The records of steps ``first_step`` on (those still in the window)."""
        return self.steps[max(0, first_step - self.steps_dropped):]

    def record(self, result: StepResult, path: str, sync_reasons: Iterable[str], host: HostTime | None = None,
               num_tokens: int = 0) -> None:
        record = StepRecord(result.step_id, result.kind, path, len(result.tokens), result.busy_ms, result.gap_ms,
                            result.graph, result.transport_us, host, num_tokens)
        self.steps.append(record)
        if len(self.steps) >= 2 * self.window:
            del self.steps[: self.window]  # in halves: amortized O(1) per step, and slices stay cheap
            self.steps_dropped += self.window
        self.sync_reasons.update(sync_reasons)
        self._step_kinds[record.kind.value] += 1
        self._step_paths[path] += 1
        if record.graph:
            self._graph_steps += 1
        else:
            self._eager_steps += 1

    def finish(self, seq: Sequence) -> None:
        """Take a finished request's figures; the engine need not keep the request after this."""
        self._count(seq, self._reasons)
        ttft, tpot = _latencies(seq)
        if ttft is not None:
            self._ttft.append(ttft)
        if tpot is not None:
            self._tpot.append(tpot)
        self._prompt_tokens += len(seq.prompt_token_ids)
        self._output_tokens += len(seq.output_token_ids)

    @staticmethod
    def _count(seq: Sequence, reasons: Counter[str]) -> None:
        reasons[seq.finish_reason.value if seq.finish_reason else "unfinished"] += 1

    def device_summary(self, first_step: int = 0) -> dict[str, Any]:
        """Occupancy and idle gaps over consecutive decode steps (steady decode) from ``first_step`` on."""
        busy = gaps = 0.0
        gap_list: list[float] = []
        previous: StepRecord | None = None
        for record in self.steps_since(first_step):
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

    def summary(self, pending: Iterable[Sequence], wall_s: float) -> dict[str, Any]:
        """Figures over the requests handed back so far and ``pending`` (those the engine still holds)."""
        live = list(pending)
        reasons = Counter(self._reasons)
        ttft, tpot = list(self._ttft), list(self._tpot)
        prompt_tokens, output_tokens = self._prompt_tokens, self._output_tokens
        for seq in live:
            self._count(seq, reasons)
            first, per_token = _latencies(seq)
            ttft += [first] if first is not None else []
            tpot += [per_token] if per_token is not None else []
            prompt_tokens += len(seq.prompt_token_ids)
            output_tokens += len(seq.output_token_ids)
        transport = [r.transport_us for r in self.steps if r.transport_us is not None]
        return {
            "requests": sum(reasons.values()),
            "requests_failed": reasons.get(FinishReason.error.value, 0),
            "finish_reasons": dict(reasons),
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "wall_s": wall_s,
            "tokens_per_s": output_tokens / wall_s if wall_s > 0 else None,
            "ttft_ms_p50": percentile(ttft, 50),
            "ttft_ms_p99": percentile(ttft, 99),
            "tpot_ms_p50": percentile(tpot, 50),
            "tpot_ms_p99": percentile(tpot, 99),
            "steps": self.num_steps,
            "steps_prefill": self._step_kinds.get(StepKind.prefill.value, 0),
            "steps_decode": self._step_kinds.get(StepKind.decode.value, 0),
            "steps_sync": self._step_paths.get("sync", 0),
            "steps_async": self._step_paths.get("async", 0),
            "graph_steps": self._graph_steps,
            "eager_steps": self._eager_steps,
            "transport_us_p50": percentile(transport, 50),
            "transport_us_p99": percentile(transport, 99),
            "sync_step_reasons": dict(self.sync_reasons),
            **self.device_summary(self.steps_dropped),
        }


def _latencies(seq: Sequence) -> tuple[float | None, float | None]:
    """Time to first token and time per output token after it, in ms (None where not defined)."""
    if seq.first_token_time is None:
        return None, None
    ttft = (seq.first_token_time - seq.arrival_time) * 1e3
    if seq.finish_time is None or len(seq.output_token_ids) < 2:
        return ttft, None
    return ttft, (seq.finish_time - seq.first_token_time) * 1e3 / (len(seq.output_token_ids) - 1)
