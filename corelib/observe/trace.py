"""Timeline traces in the Chrome trace event format (open in Perfetto or chrome://tracing).

Host spans are timed with ``time.perf_counter()`` on the thread that records them, one lane
per lane name (the thread's name unless the caller gives one). Device spans come from the
events each step records anyway (``StepHandle.timing``) and are placed on the host clock
through an anchor: an event recorded on an otherwise idle stream, waited for, and paired
with the host time of that wait; ``anchor.elapsed_ms(event)`` then places every later
event. The anchor is taken again about once a second and the mapping corrected only when it
no longer places the new anchor inside the host's wait for it: drift between the device timer
and the host clock cannot build up, and spans do not jump while the two clocks agree.

The engine's default tracer is :data:`NULL_TRACER`, whose methods do nothing: a disabled
trace costs one method call per hook and creates no event. :class:`TimelineTracer` keeps
at most ``max_events`` spans, then stops recording and says so in the file.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from corelib.platform.device import Device, Event, Stream
from corelib.step.handoff import StepHandle, TokenHandoff
from corelib.trust.files import write_whole

MAX_EVENTS = 200_000
REANCHOR_S = 1.0  # longest time between two anchors of the device clock

# Lane names the engine uses; the renderer orders lanes this way, others after them.
SCHEDULER_LANE = "scheduler"
POLLING_LANE = "polling"
HOST_LANE_ORDER = (SCHEDULER_LANE, POLLING_LANE)
DEVICE_LANE_ORDER = ("compute", "prepare", "d2h")

HOST_CATEGORY = "host"
MARK_CATEGORY = "mark"  # a point in time on a host lane
STEP_CATEGORY = "step"  # a step's compute span: H2D of its inputs, the forward, sampling
COPY_CATEGORY = "copy"  # a device copy such as the D2H of a step's tokens
DEVICE_CATEGORIES = frozenset({STEP_CATEGORY, COPY_CATEGORY})
HOST_PID, DEVICE_PID = 1, 2

# (category, name, lane, start in host seconds, duration in seconds, args)
Record = tuple[str, str, str, float, float, Mapping[str, object] | None]

_NO_SPAN: AbstractContextManager[None] = nullcontext()


class Tracer:
    """The tracer interface; this one records nothing (``engine.trace=false``).

    Every method may be called from any thread.
    """

    enabled = False

    def span(self, name: str, lane: str | None = None, **args: object) -> AbstractContextManager[None]:
        """A host span around a ``with`` block, on ``lane`` (default: the current thread's name)."""
        return _NO_SPAN

    def instant(self, name: str, lane: str | None = None, **args: object) -> None:
        """A point in time on a host lane."""

    def step(self, handle: StepHandle, path: str) -> None:
        """The device spans of a completed step: its compute span, and its D2H where that was timed."""


NULL_TRACER = Tracer()


class _HostSpan:
    __slots__ = ("_args", "_lane", "_name", "_start", "_tracer")

    def __init__(self, tracer: TimelineTracer, name: str, lane: str, args: Mapping[str, object] | None) -> None:
        self._tracer, self._name, self._lane, self._args = tracer, name, lane, args
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        start = self._start
        self._tracer.add((HOST_CATEGORY, self._name, self._lane, start, time.perf_counter() - start, self._args))


class TimelineTracer(Tracer):
    """Records host and device spans in memory; :meth:`write` saves them as ``trace.json``."""

    enabled = True

    def __init__(self, max_events: int = MAX_EVENTS, reanchor_s: float = REANCHOR_S) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be positive, got {max_events}")
        self.max_events = max_events
        self.reanchor_s = reanchor_s
        self.notes: list[str] = []
        self._records: list[Record] = []
        # itertools.count is advanced atomically under the GIL: below the cap, adding takes no lock.
        self._counter = itertools.count()
        self._dropped = 0
        self._drop_lock = threading.Lock()
        self._truncated_at: float | None = None
        self._origin = time.perf_counter()
        self._device: Device | None = None
        self._anchor_stream: Stream | None = None
        self._anchor: tuple[Event, float] | None = None  # (event, host time); replaced whole, never mutated
        self._time_tokens = False

    @classmethod
    def for_handoff(cls, handoff: TokenHandoff, max_events: int = MAX_EVENTS) -> TimelineTracer:
        """A tracer for an in-process engine: anchors its device clock and times its token copies."""
        tracer = cls(max_events)
        if not handoff.timing:
            tracer.notes.append("no device spans: this device's events carry no timing")
            return tracer
        handoff.enable_token_timing()
        tracer._time_tokens = True
        tracer.anchor_device(handoff.device)
        return tracer

    # ------------------------------------------------------------------ recording
    def add(self, record: Record) -> None:
        """Keep one record, unless the cap is reached."""
        if next(self._counter) < self.max_events:
            self._records.append(record)
            return
        with self._drop_lock:
            if not self._dropped:
                self._truncated_at = time.perf_counter()
            self._dropped += 1

    @property
    def num_dropped(self) -> int:
        """Spans not kept because the cap was reached."""
        return self._dropped

    def extend(self, records: Iterable[Record], lane_prefix: str = "") -> None:
        """Add records taken in another tracer, e.g. one in a worker process (same host clock)."""
        for category, name, lane, start, duration, args in records:
            self.add((category, name, lane_prefix + lane, start, duration, args))

    def records(self) -> list[Record]:
        """The records so far (plain tuples: they pickle, for sending to another process)."""
        return list(self._records)

    def span(self, name: str, lane: str | None = None, **args: object) -> AbstractContextManager[None]:
        return _HostSpan(self, name, lane or threading.current_thread().name, args or None)

    def instant(self, name: str, lane: str | None = None, **args: object) -> None:
        self.add((MARK_CATEGORY, name, lane or threading.current_thread().name, time.perf_counter(), 0.0,
                  args or None))

    # ------------------------------------------------------------------ device clock
    def anchor_device(self, device: Device) -> None:
        """Tie ``device``'s event times to the host clock (and keep them tied, see REANCHOR_S)."""
        self._device = device
        # A stream of its own is idle whatever the engine's streams run, so its event is
        # timestamped as soon as it is recorded.
        self._anchor_stream = device.stream("trace-anchor")
        device.synchronize()  # where streams share one queue, the first anchor must not wait behind work
        self._reanchor()

    def _reanchor(self) -> None:
        """Called from the thread that reads step tokens (the scheduler), which the wait briefly blocks."""
        device, stream = self._device, self._anchor_stream
        if device is None or stream is None:
            return
        event = device.event(timing=True, name="trace.anchor")
        before = time.perf_counter()
        stream.record(event)
        event.synchronize()
        after = time.perf_counter()
        # The device stamped the event between the two host reads. The first anchor takes the midpoint;
        # later ones keep the current mapping unless it places the event outside that window.
        host = (before + after) / 2 if self._anchor is None else min(max(self._host_time(event), before), after)
        self._anchor = (event, host)
        self.add((HOST_CATEGORY, "trace anchor", SCHEDULER_LANE, before, after - before, None))

    def _host_time(self, event: Event) -> float:
        anchor = self._anchor
        if anchor is None:
            raise RuntimeError("device spans need anchor_device() first")
        return anchor[1] + anchor[0].elapsed_ms(event) / 1e3

    def _device_record(self, category: str, name: str, start: Event, end: Event, lane: str | None,
                       args: Mapping[str, object] | None) -> None:
        begin = self._host_time(start)
        lane = lane or end.stream_name or "device"
        self.add((category, name, lane, begin, self._host_time(end) - begin, args))

    def step(self, handle: StepHandle, path: str) -> None:
        anchor = self._anchor
        start, end = handle.timing.start, handle.timing.end
        if anchor is None or start is None or end is None:
            return
        if time.perf_counter() - anchor[1] > self.reanchor_s:
            self._reanchor()
        kind, step_id = handle.kind.value, handle.step_id
        args = {"step": step_id, "kind": kind, "batch": handle.num_seqs, "path": path}
        self._device_record(STEP_CATEGORY, f"{kind} {step_id}", start, end, None, args)
        if self._time_tokens:
            # The D2H stream waits for the step's end event, then copies: the span starts there.
            self._device_record(COPY_CATEGORY, f"d2h {step_id}", end, handle.ready_event(), None, {"step": step_id})

    # ------------------------------------------------------------------ output
    def trace_events(self) -> list[dict[str, Any]]:
        """The records as Chrome trace events: lane metadata first, then spans in time order."""
        records = list(self._records)
        origin = min([self._origin, *(r[3] for r in records)])
        lanes: dict[tuple[int, str], int] = {}
        for category, _, lane, *_ in records:
            pid = DEVICE_PID if category in DEVICE_CATEGORIES else HOST_PID
            lanes.setdefault((pid, lane), len(lanes) + 1)
        events: list[dict[str, Any]] = [
            {"ph": "M", "pid": HOST_PID, "name": "process_name", "args": {"name": f"host (pid {os.getpid()})"}},
            {"ph": "M", "pid": HOST_PID, "name": "process_sort_index", "args": {"sort_index": 0}},
            {"ph": "M", "pid": DEVICE_PID, "name": "process_name", "args": {"name": self._device_label()}},
            {"ph": "M", "pid": DEVICE_PID, "name": "process_sort_index", "args": {"sort_index": 1}},
        ]
        for (pid, lane), tid in lanes.items():
            order = HOST_LANE_ORDER if pid == HOST_PID else DEVICE_LANE_ORDER
            sort = order.index(lane) if lane in order else len(order) + tid
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": lane}})
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                           "args": {"sort_index": sort}})
        for category, name, lane, start, duration, args in sorted(records, key=lambda r: r[3]):
            pid = DEVICE_PID if category in DEVICE_CATEGORIES else HOST_PID
            event: dict[str, Any] = {"ph": "X", "cat": category, "name": name, "pid": pid,
                                     "tid": lanes[(pid, lane)], "ts": (start - origin) * 1e6,
                                     "dur": max(duration, 0.0) * 1e6}
            if category == MARK_CATEGORY:
                event.update(ph="i", s="t")
                del event["dur"]
            if args:
                event["args"] = dict(args)
            events.append(event)
        if self._truncated_at is not None:
            events.append({"ph": "i", "s": "g", "pid": HOST_PID, "tid": 0, "name": "trace truncated",
                           "ts": (self._truncated_at - origin) * 1e6, "args": {"max_events": self.max_events}})
        return events

    def _device_label(self) -> str:
        device = self._device
        return "device" if device is None else f"device ({device.name}, {device.runtime.value})"

    def write(self, path: Path | str, metadata: Mapping[str, object] | None = None) -> Path:
        """Write ``trace.json``; ``metadata`` goes into ``otherData.corelib`` (what ran, for the renderer)."""
        dropped = self._dropped
        notes = list(self.notes)
        if dropped:
            notes.append(f"recording stopped after {self.max_events} events; {dropped} more were dropped")
        payload = {
            "traceEvents": self.trace_events(),
            "displayTimeUnit": "ms",
            "otherData": {"corelib": {**(metadata or {}), "max_events": self.max_events,
                                      "dropped_events": dropped, "notes": notes}},
        }
        return write_whole(Path(path), json.dumps(payload) + "\n")  # never through a link planted at the name
