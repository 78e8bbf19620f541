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
from corelib.support.stats import percentile

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
    wake_us: float | None = None  # SHM: of transport_us, the part until the frame was in the worker's hands


WINDOW = 10_000  # requests and steps kept for percentiles and device spans

# A step as the window keeps it: (step_id, kind's value, path, num_seqs, busy_ms, gap_ms, graph, transport_us,
# (schedule_us, pack_us, postprocess_us) or None, num_tokens, wake_us). Plain tuples of numbers and strings leave the
# garbage collector's lists once they survive a pass; 10-20 k StepRecords (and their HostTimes) would stay on
# them, and every pass of the generation they sit in would walk them between two steps (passes of 4-12.5 ms on
# the H200's host, in a mixed-traffic run).
_Row = tuple[int, str, str, int, float | None, float | None, bool, float | None, tuple[float, float, float] | None,
             int, float | None]


def _record(row: _Row) -> StepRecord:
    host = row[8]
    return StepRecord(row[0], StepKind(row[1]), row[2], row[3], row[4], row[5], row[6], row[7],
                      None if host is None else HostTime(*host), row[9], row[10])


class MetricsCollector:
    """Collects step records as steps complete and request figures as requests are handed back."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._rows: list[_Row] = []  # the latest steps: between window and 2 * window of them
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
        return self.steps_dropped + len(self._rows)

    def steps_since(self, first_step: int) -> list[StepRecord]:
        """The records of steps ``first_step`` on (those still in the window)."""
        return [_record(row) for row in self._rows_since(first_step)]

    def _rows_since(self, first_step: int) -> list[_Row]:
        return self._rows[max(0, first_step - self.steps_dropped):]

    def record(self, result: StepResult, path: str, sync_reasons: Iterable[str], host: HostTime | None = None,
               num_tokens: int = 0) -> None:
        kind = result.kind.value
        times = None if host is None else (host.schedule_us, host.pack_us, host.postprocess_us)
        self._rows.append((result.step_id, kind, path, len(result.tokens), result.busy_ms, result.gap_ms,
                           result.graph, result.transport_us, times, num_tokens, result.wake_us))
        if len(self._rows) >= 2 * self.window:
            del self._rows[: self.window]  # in halves: amortized O(1) per step, and slices stay cheap
            self.steps_dropped += self.window
        self.sync_reasons.update(sync_reasons)
        self._step_kinds[kind] += 1
        self._step_paths[path] += 1
        if result.graph:
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
        decode = StepKind.decode.value
        previous_kind = None
        for row in self._rows_since(first_step):
            kind, busy_ms, gap_ms = row[1], row[4], row[5]
            if kind == decode and busy_ms is not None:
                busy += busy_ms
                if previous_kind == decode and gap_ms is not None:
                    gaps += gap_ms
                    gap_list.append(gap_ms)
            previous_kind = kind
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
        transport = [row[7] for row in self._rows if row[7] is not None]
        wake = [row[10] for row in self._rows if row[10] is not None]
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
            "transport_wake_us_p50": percentile(wake, 50),  # of the hop, until the frame was in the worker's hands
            "transport_wake_us_p99": percentile(wake, 99),
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
