"""The decode loop: schedule, pack, submit, and take tokens back, one step ahead when allowed.

Synchronous handoff: every step's tokens are read before the next step is scheduled.
Async handoff: step N+1 is scheduled and submitted (its input tokens on the device relay)
before the host reads step N's tokens, so the device has the next step queued while the
host does its bookkeeping. A step whose batch fails a per-step requirement of the gate
(a multimodal request, host-side stop strings) runs synchronously, after a drain.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from corelib.engine.block_manager import blocks_for
from corelib.engine.buckets import BucketPolicy
from corelib.engine.executor import Executor, StepFuture
from corelib.engine.forward_input import InputBuilder
from corelib.engine.handoff import StagingPool
from corelib.engine.metrics import WINDOW, MetricsCollector
from corelib.engine.scheduler import Drain, ScheduledStep, Scheduler, StepKind
from corelib.engine.sequence import FinishReason, Sequence
from corelib.engine.trace import NULL_TRACER, SCHEDULER_LANE, Tracer

SyncCheck = Callable[[list[Sequence]], list[str]]


@dataclass
class InFlight:
    step: ScheduledStep
    future: StepFuture
    path: str


class EngineCore:
    """Owns the loop state; the Engine facade builds it and feeds it requests."""

    def __init__(
        self,
        scheduler: Scheduler,
        builder: InputBuilder,
        buckets: BucketPolicy,
        executor: Executor,
        staging: StagingPool,
        async_handoff: bool,
        sync_check: SyncCheck,
        timeout_s: float,
        metrics_window: int = WINDOW,
    ) -> None:
        self.scheduler = scheduler
        self.builder = builder
        self.buckets = buckets
        self.executor = executor
        self.staging = staging
        self.async_handoff = async_handoff
        self._sync_check = sync_check
        self.timeout_s = timeout_s
        self.metrics = MetricsCollector(metrics_window)
        self._in_flight: deque[InFlight] = deque()
        self._next_step_id = 0
        self.finished: list[Sequence] = []
        self.tracer: Tracer = NULL_TRACER

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def iterate(self) -> bool:
        """Advance the loop by one decision. False when there is nothing left to do."""
        with self.tracer.span("schedule", SCHEDULER_LANE):
            decision = self.scheduler.schedule(in_flight=bool(self._in_flight), sync_check=self._check)
        if isinstance(decision, ScheduledStep):
            self._submit(decision)
            if decision.synchronous or not self.async_handoff:
                self.drain()
            elif len(self._in_flight) > 1:
                self._complete_oldest()
            return True
        if self._in_flight:
            self._complete_oldest()
            return True
        if decision is Drain.token:
            raise RuntimeError("the scheduler asked for a drain with nothing in flight")
        return self.scheduler.has_unfinished and self._unblock()

    def drain(self) -> None:
        """Read every in-flight step's tokens."""
        while self._in_flight:
            self._complete_oldest()

    def _check(self, seqs: list[Sequence]) -> list[str]:
        return self._sync_check(seqs) if self.async_handoff else []

    def _submit(self, step: ScheduledStep) -> None:
        step_id = self._next_step_id
        self._next_step_id += 1
        if step.kind is StepKind.decode:
            kv_needed = max(blocks_for(p + 1, self.builder.block_size) for p in step.positions)
            rows, kv, _ = self.buckets.decode_shape(len(step.seqs), kv_needed)
        else:
            rows, kv = len(step.seqs), 0
        arena = self.staging.acquire()
        try:
            with self.tracer.span("pack", SCHEDULER_LANE, step=step_id):
                fi = self.builder.fill(step_id, step, arena, rows, kv)
            if not self.executor.copies_inputs:
                fi.on_release = lambda: self.staging.release(arena)  # once the device no longer reads it
            with self.tracer.span("submit", SCHEDULER_LANE, step=step_id):
                future = self.executor.submit(fi)
        except BaseException:
            self.staging.release(arena)
            raise
        if self.executor.copies_inputs:
            self.staging.release(arena)
        path = "async" if self.async_handoff and not step.synchronous else "sync"
        self._in_flight.append(InFlight(step, future, path))

    def _complete_oldest(self) -> None:
        item = self._in_flight.popleft()
        with self.tracer.span("wait for tokens", SCHEDULER_LANE):
            result = item.future.result(self.timeout_s)
        self.metrics.record(result, item.path, item.step.sync_reasons)
        if result.handle is not None:
            self.tracer.step(result.handle, item.path)
        with self.tracer.span("postprocess", SCHEDULER_LANE):
            self.finished.extend(self.scheduler.postprocess(item.step, result.tokens))

    def _unblock(self) -> bool:
        """Nothing runs and nothing can be scheduled: fail the first waiting request, never hang."""
        seq = self.scheduler.waiting[0]
        self.scheduler.finish(
            seq,
            FinishReason.error,
            error=f"request needs {blocks_for(seq.num_tokens, self.builder.block_size)} KV blocks; "
            f"the pool has {self.scheduler.blocks.num_free_blocks} free with nothing running",
        )
        self.finished.append(seq)
        return True

    def cancel_in_flight(self) -> None:
        """Wait (bounded) for in-flight steps so the device no longer reads their inputs; drop their tokens."""
        while self._in_flight:
            self._in_flight.popleft().future.result(self.timeout_s)

    def attach_tracer(self, tracer: Tracer) -> None:
        """Record host spans of the loop and device spans of every completed step into ``tracer``."""
        self.tracer = tracer
        self.executor.attach_tracer(tracer)

    def close(self) -> None:
        self.executor.close(self.timeout_s)
