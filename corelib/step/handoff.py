"""Token handoff: how each step's sampled tokens reach the next step and the host.

On the device, each step's samples are scattered into a relay by state index (``seq_tokens``): the
next step's input ids come from there, never through the host. Each step's tokens are also
copied into one of ``depth`` device buffers and, by a non-blocking D2H on their own stream,
into the matching pinned host buffer; that copy's event is what the host waits for, only when
it needs the tokens. A step that computes logprobs copies its rows' logprobs the same way, beside
its tokens.

Events are made once and re-recorded: one set per token buffer, and timing events in a ring
one longer than the pipeline, so a step's events stay intact until the host has read them
and the step after it (whose idle gap they measure) has been read too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from corelib.platform.device import Device, Event, Stream
from corelib.step.fields import LOGPROB_WIDTH
from corelib.step.forward_input import StepKind


@dataclass(frozen=True)
class StepResult:
    """What comes back for one step, from this process's device or from a worker."""

    step_id: int
    kind: StepKind
    tokens: list[int]
    busy_ms: float | None = None  # device time of the step (events)
    gap_ms: float | None = None  # device idle time since the previous step ended (events)
    graph: bool = False  # a decode step that replayed a captured graph
    transport_us: float | None = None  # SHM: the producer's stamp (or the worker ready, if later) to inputs ready
    handle: StepHandle | None = None  # in-process steps: the handle, whose events a tracer reads
    logprobs: list[list[float]] | None = None  # per row: LOGPROB_WIDTH floats (see corelib.step.fields)
    prompt_logprobs: list[list[float]] | None = None  # per prompt position the step computed: LOGPROB_WIDTH floats
    wake_us: float | None = None  # SHM: of transport_us, the part until the frame was in the worker's hands


@dataclass
class StepTiming:
    """Device-side span of one step, read from its events once they completed."""

    start: Event | None
    end: Event | None


class StepHandle:
    """A submitted step. Its tokens are valid in pinned host memory once ``event`` completes."""

    def __init__(
        self, step_id: int, kind: StepKind, num_seqs: int, buffer: int, event: Event | None, timing: StepTiming,
        graph: bool, keepalive: tuple[object, ...], on_done: Callable[[], None] | None = None,
        logprobs: bool = False, prompt: PromptBuffers | None = None,
    ) -> None:
        self.step_id = step_id
        self.kind = kind
        self.num_seqs = num_seqs
        self.buffer = buffer
        self.event = event  # None while the step's sampling waits for its grammar mask
        self.timing = timing
        self.graph = graph  # the step replayed a captured graph
        # Inputs stay referenced until the output event completes: the device may still read them.
        self.keepalive: tuple[object, ...] | None = keepalive
        self.on_done = on_done  # gives the step's inputs back once the device no longer reads them
        self.logprobs = logprobs  # the step copied its rows' logprobs too
        self.prompt = prompt  # the step's prompt logprobs, copied to the host with its tokens
        self.tokens: list[int] | None = None
        self.logprob_rows: list[list[float]] | None = None
        self.prompt_rows: list[list[float]] | None = None

    def done(self) -> bool:
        return self.tokens is not None or (self.event is not None and self.event.query())

    def ready_event(self) -> Event:
        """The event the step's tokens are in host memory after; RuntimeError while its grammar mask is owed (the
        tokens of a step whose sampling is not queued would never come)."""
        if self.event is None:
            raise RuntimeError(f"step {self.step_id}: its tokens were waited for before its grammar mask was supplied "
                               f"(its sampling is not queued)")
        return self.event


@dataclass(frozen=True)
class PromptBuffers:
    """Where one step's prompt logprobs go: ``device`` [P, LOGPROB_WIDTH], written by the runner, then ``host``
    (pinned). Made for the step that needs them, so no other step holds or copies more than before."""

    device: torch.Tensor
    host: torch.Tensor


@dataclass
class _Buffer:
    tokens_event: Event
    busy: bool = False


class TokenHandoff:
    """The relay, the device and pinned token buffers, and the events that order them."""

    def __init__(self, device: Device, compute: Stream, rows: int, num_states: int, depth: int,
                 timing: bool) -> None:
        if depth < 1:
            raise ValueError(f"the pipeline depth must be at least 1, got {depth}")
        self.device = device
        self.compute = compute
        self.depth = depth
        caps = device.capabilities
        self.d2h = device.stream("d2h") if caps.streams else compute
        self.timing = timing and caps.event_timing
        self.time_tokens = False  # a trace times each step's D2H too: its tokens events then carry timing
        # Per-sequence relay of the latest sampled token, by state index; the last absorbs padded rows.
        self.seq_tokens = device.zeros((num_states + 1,), torch.int64)
        self.next_tokens = device.zeros((rows,), torch.int64)
        self.relay = device.zeros((depth, rows), torch.int64)
        self.host = device.host_empty((depth, rows), torch.int64, pinned=True)
        # Logprobs, only for steps that compute them: the same path as the tokens, LOGPROB_WIDTH floats a row.
        self.next_logprobs = device.zeros((rows, LOGPROB_WIDTH), torch.float32)
        self.relay_logprobs = device.zeros((depth, rows, LOGPROB_WIDTH), torch.float32)
        self.host_logprobs = device.host_empty((depth, rows, LOGPROB_WIDTH), torch.float32, pinned=True)
        self._buffers: list[_Buffer] = []
        self._ring: list[StepTiming] = []
        self._make_events()
        self._next = 0
        self._steps = 0
        self._lock = threading.Lock()
        self._prev_end: Event | None = None

    def _make_events(self) -> None:
        device = self.device
        self._buffers = [
            _Buffer(device.event(blocking=True, timing=self.time_tokens, name=f"tokens[{i}]"))
            for i in range(self.depth)
        ]
        self._ring = [
            StepTiming(device.event(timing=True, name=f"step.start[{i}]") if self.timing else None,
                       device.event(timing=self.timing, name=f"step.end[{i}]"))
            for i in range(self.depth + 1)
        ]

    def enable_token_timing(self) -> None:
        """Give the D2H events timing (a trace draws the copies); call before the first step."""
        if self._steps:
            raise RuntimeError("token timing must be enabled before the first step")
        self.time_tokens = True
        self._make_events()

    # ------------------------------------------------------------------ inside the device step
    def publish_targets(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a step of ``rows`` rows publishes its samples (``Ops.sample_publish``, or
        ``corelib.ops.composed.publish_checked``): what the host reads of them (next_tokens), and the relay the
        next step's inputs read (seq_tokens, by state index; a row that sampled nothing, a chunk short of its
        prompt's end, names the padding slot, so its token never reaches the relay)."""
        return self.next_tokens[:rows], self.seq_tokens

    def publish_logprobs(self, rows: int, logprobs: torch.Tensor) -> None:
        """Keep a step's logprob rows [rows, LOGPROB_WIDTH] for the host (a step that computes them)."""
        self.next_logprobs[:rows].copy_(logprobs)

    # ------------------------------------------------------------------ around the device step
    def begin(self, step_id: int) -> tuple[int, StepTiming]:
        """Claim the next token buffer and timing events; records the step's start."""
        with self._lock:
            index = self._next
            buffer = self._buffers[index]
            if buffer.busy:
                raise RuntimeError(
                    f"step {step_id}: token buffer {index} is reused before the tokens of the step "
                    f"{self.depth} back were read; the engine must read each step's tokens before submitting "
                    f"{self.depth} more"
                )
            buffer.busy = True
            self._next = (index + 1) % self.depth
            timing = self._ring[self._steps % len(self._ring)]
            self._steps += 1
        # Reused events carry the step's name, so a wait that times out says which step it was.
        buffer.tokens_event.name = f"step{step_id}.tokens"
        if timing.end is not None:
            timing.end.name = f"step{step_id}.end"
        if timing.start is not None:
            timing.start.name = f"step{step_id}.start"
            self.compute.record(timing.start)
        return index, timing

    def prompt_buffers(self, count: int) -> PromptBuffers:
        """Buffers for the logprobs of ``count`` prompt positions of one step (made before it is queued)."""
        return PromptBuffers(self.device.empty((count, LOGPROB_WIDTH), torch.float32),
                             self.device.host_empty((count, LOGPROB_WIDTH), torch.float32, pinned=True))

    def emit(self, index: int, num_seqs: int, timing: StepTiming, logprobs: bool = False,
             prompt: PromptBuffers | None = None) -> Event:
        """After the forward: copy the tokens (and the logprobs of a step that computed them) to buffer
        ``index`` and on to the host; returns the host event."""
        compute, n = self.compute, num_seqs
        # relay[index] was last read by the D2H of the step `depth` back; its tokens were read on
        # the host (the busy check in begin), so that copy has finished and the buffer is free.
        compute.copy(self.relay[index, :n], self.next_tokens[:n])
        if logprobs:
            compute.copy(self.relay_logprobs[index, :n], self.next_logprobs[:n])
        end = timing.end
        if end is None:
            raise RuntimeError("every step records an end event")
        compute.record(end)
        if self.d2h is not compute:
            self.d2h.wait(end)
        self.d2h.copy(self.host[index, :n], self.relay[index, :n])
        if logprobs:
            self.d2h.copy(self.host_logprobs[index, :n], self.relay_logprobs[index, :n])
        if prompt is not None:
            self.d2h.copy(prompt.host, prompt.device)
        event = self._buffers[index].tokens_event
        self.d2h.record(event)
        return event

    def read(self, handle: StepHandle, timeout: float | None = None) -> StepResult:
        """Wait (bounded, without the GIL) for a step's tokens and read its device span. In submission order."""
        if handle.tokens is None:
            handle.ready_event().synchronize(timeout)
            handle.tokens = self.host[handle.buffer, : handle.num_seqs].tolist()
            if handle.logprobs:
                handle.logprob_rows = self.host_logprobs[handle.buffer, : handle.num_seqs].tolist()
            if handle.prompt is not None:
                handle.prompt_rows, handle.prompt = handle.prompt.host.tolist(), None
            handle.keepalive = None
            self._buffers[handle.buffer].busy = False
            done, handle.on_done = handle.on_done, None
            if done is not None:
                done()
        busy = gap = None
        start, end = handle.timing.start, handle.timing.end
        if start is not None and end is not None and self.timing:
            busy = start.elapsed_ms(end)
            if self._prev_end is not None:
                gap = max(0.0, self._prev_end.elapsed_ms(start))
        self._prev_end = end if self.timing else None
        return StepResult(handle.step_id, handle.kind, handle.tokens, busy, gap, handle.graph, handle=handle,
                          logprobs=handle.logprob_rows, prompt_logprobs=handle.prompt_rows)
