"""The decode loop: schedule, pack, submit, and take tokens back, running ahead where allowed.

Synchronous handoff: every step's tokens are read before the next step is scheduled.
Async handoff: step N+1 is scheduled and submitted (its input tokens on the device relay)
before the host reads step N's tokens, so the device has the next step queued while the
host does its bookkeeping; the step pipeline says how far ahead. A step whose batch fails a
per-step requirement of the gate (a multimodal request, host-side stop strings; decided once
per request, when it is added) runs synchronously, after a drain.

Structured output run ahead (``structured_overlap``): a step holding a grammar's row is queued
before the previous step's tokens are read, owing its mask; once every earlier step is read
(each grammar has taken its token) the masks are written (on the mask thread while the loop
schedules and packs the next step, where the machine has cores to spare), and the step's sampling
is queued behind its forward once they are. No step is queued while one owes its mask, so no
forward reads a token that is not sampled yet.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from corelib.config.options import StepCheck
from corelib.engine.packing import InputBuilder, PackingError
from corelib.engine.scheduler import NoStep, ScheduledStep, Scheduler
from corelib.engine.sequence import FinishReason, Sequence
from corelib.engine.step_masks import MaskThread, StepMasks
from corelib.engine.structured import mask_threads
from corelib.observe.metrics import WINDOW, HostTime, MetricsCollector, StepRecord
from corelib.observe.trace import NULL_TRACER, SCHEDULER_LANE, Tracer
from corelib.platform.device import MemoryStats
from corelib.step.buckets import BucketPolicy, blocks_for
from corelib.step.forward_input import ForwardInput, StepKind
from corelib.step.pipeline import StepPipeline
from corelib.transport.executor import Executor, StepFuture


@dataclass(frozen=True)
class EngineStats:
    """The loop's state now, and (with ``since_step``) the steps it has run since then."""

    num_steps: int  # steps completed so far
    num_running: int
    num_waiting: int
    num_in_flight: int  # steps submitted whose tokens were not read yet
    kv_blocks_free: int
    kv_blocks_total: int  # usable blocks (the null block is never handed out)
    num_preemptions: int
    prefix_cache_queried_tokens: int = 0  # prompt tokens of admitted requests, looked up in the prefix cache
    prefix_cache_hit_tokens: int = 0  # of those, the tokens found there (not computed again)
    prefix_cache_evicted_blocks: int = 0  # cached blocks handed out again, their prefix forgotten
    steps: tuple[StepRecord, ...] = ()  # completed since ``since_step`` (within the metrics window)
    device: Mapping[str, Any] = field(default_factory=dict)  # device busy/idle over those steps


@dataclass
class InFlight:
    step: ScheduledStep
    future: StepFuture
    path: str
    schedule_s: float = 0.0  # host time the scheduler took to choose this step
    pack_s: float = 0.0  # host time to pack it into its arena (and to wait for its grammar masks)
    fi: ForwardInput | None = None  # a step that owes its grammar mask: what it was packed into
    masks: StepMasks | None = None  # that mask, once its grammars' rows are being computed...
    computing: Future[None] | None = None  # ...by this job of the mask thread


class EngineCore:
    """Owns the loop state: the pipeline of steps in flight, finished requests and the metrics."""

    def __init__(
        self,
        scheduler: Scheduler,
        builder: InputBuilder,
        buckets: BucketPolicy,
        executor: Executor,
        pipeline: StepPipeline[InFlight],
        step_check: StepCheck,
        timeout_s: float,
        metrics_window: int = WINDOW,
    ) -> None:
        self.scheduler = scheduler
        self.builder = builder
        self.buckets = buckets
        self.executor = executor
        self.pipeline = pipeline
        self._step_check = step_check
        self.timeout_s = timeout_s
        self.metrics = MetricsCollector(metrics_window)
        self._next_step_id = 0
        self._finished: list[Sequence] = []
        self.tracer: Tracer = NULL_TRACER
        self._mask_thread: MaskThread | None = None  # started with the first step that owes its grammar masks
        # Compute a step's owed masks on the mask thread while the next step is packed: where llguidance's pool
        # has more than one thread (more than two CPUs). On two, the loop, the pool's thread and the mask thread
        # share both cores and each hand-over costs as much as the overlap saves (benchmarks/json_paced.py).
        self.masks_beside_packing = mask_threads() > 1

    @property
    def num_in_flight(self) -> int:
        return len(self.pipeline)

    # ------------------------------------------------------------------ requests
    def wake_if_idle(self) -> None:
        """A request is coming (call it before the request is checked and tokenized): where the engine is idle, its
        first step follows, so the executor may start waking what runs it now."""
        if not self.pipeline and not self.scheduler.has_unfinished:
            self.executor.wake()

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; its per-step sync facts are decided now, once, not at every step."""
        seq.sync_mask = self._step_check.facts_of(seq)
        self.scheduler.add(seq)

    def add_group(self, seqs: list[Sequence]) -> None:
        """Queue the requests of one prompt (an API's ``n``): they share its KV blocks once it is computed."""
        for seq in seqs:
            seq.sync_mask = self._step_check.facts_of(seq)
        self.scheduler.add_group(seqs)

    # ------------------------------------------------------------------ finished requests
    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """End ``seq`` now (its blocks and slot go back); its output is returned by the next ``take_finished``."""
        self.scheduler.finish(seq, reason, error=error)
        self._finished.append(seq)

    def finish_all(self, reason: FinishReason, error: str | None = None) -> None:
        """End every unfinished request (shutdown, or a fatal device error)."""
        self._finished.extend(self.scheduler.abort_all(reason, error=error))

    def take_finished(self) -> list[Sequence]:
        """Requests that finished since the last call; their figures stay in the metrics."""
        done, self._finished = self._finished, []
        for seq in done:
            self.metrics.finish(seq)
        return done

    def stats(self, since_step: int | None = None) -> EngineStats:
        """Counts now; with ``since_step`` (an earlier ``num_steps``) also the steps since and their device figures."""
        blocks = self.scheduler.blocks
        steps: tuple[StepRecord, ...] = ()
        device: dict[str, Any] = {}
        if since_step is not None:
            steps = tuple(self.metrics.steps_since(since_step))
            device = self.metrics.device_summary(since_step)
        cache = blocks.stats
        return EngineStats(self.metrics.num_steps, len(self.scheduler.running), len(self.scheduler.waiting),
                           len(self.pipeline), blocks.num_free_blocks, blocks.num_blocks - 1,
                           self.scheduler.num_preemptions, cache.queried_tokens, cache.hit_tokens,
                           cache.evicted_blocks, steps, device)

    def metrics_summary(self, wall_s: float) -> dict[str, Any]:
        pending = [*self.scheduler.running, *self.scheduler.waiting, *self._finished]
        cache = self.scheduler.blocks.stats
        prefix = {
            "prefix_cache_queried_tokens": cache.queried_tokens,
            "prefix_cache_hit_tokens": cache.hit_tokens,
            "prefix_cache_hit_rate": cache.hit_rate if cache.queried_tokens else None,
            "prefix_cache_evicted_blocks": cache.evicted_blocks,
        }
        return {**self.metrics.summary(pending, wall_s), **prefix}

    def memory_stats(self) -> list[MemoryStats]:
        return self.executor.memory_stats()

    # ------------------------------------------------------------------ the loop
    def iterate(self) -> bool:
        """Advance the loop by one decision. False when there is nothing left to do."""
        clock = time.perf_counter
        started = clock()
        with self.tracer.span("schedule", SCHEDULER_LANE):
            decision = self.scheduler.schedule(in_flight=bool(self.pipeline), sync_check=self._step_check.reasons)
        scheduled = clock() - started
        if isinstance(decision, ScheduledStep) and not decision.seqs:
            return True  # every row gave its blocks to another (preempted): the next decision admits again
        if isinstance(decision, ScheduledStep):
            if not self.pipeline.can_submit():
                self._complete_oldest()
            packed = self._pack(decision)  # while an earlier step's masks are written on their thread
            if packed is None:
                return True
            self._settle_masks()  # the step after one that owes its mask reads the tokens that mask decides
            self._submit(decision, *packed, scheduled)
            if decision.synchronous:
                self.drain()
            while self.pipeline.must_read():
                self._complete_oldest()
            self._settle_masks(begin=True)  # written while this step's forward runs and the next one is packed
            return True
        if self.pipeline:
            self._complete_oldest()
            return True
        if decision is NoStep.drain:
            raise RuntimeError("the scheduler asked for a drain with nothing in flight")
        return self.scheduler.has_unfinished and self._unblock()

    def drain(self) -> None:
        """Read every in-flight step's tokens."""
        while self.pipeline:
            self._complete_oldest()

    def _pack(self, step: ScheduledStep) -> tuple[ForwardInput, float] | None:
        """``step`` in an arena (``fi.arena``) and the seconds that took; None when it could not be packed (its
        requests at fault end, the others wait)."""
        started = time.perf_counter()
        step_id = self._next_step_id
        self._next_step_id += 1
        kv_needed = blocks_for(max(step.seq_lens), self.builder.block_size)
        padded = 0
        if step.kind is StepKind.decode:
            rows, kv, _ = self.buckets.decode_shape(len(step.seqs), kv_needed)
        else:
            rows, kv = len(step.seqs), kv_needed
            # A step computing prompt logprobs runs eagerly: its logits are more than one a row.
            padded = 0 if step.prompt_logprobs else self.buckets.token_bucket(step.num_tokens) or 0
            if padded:  # its token bucket's graph: every row of the layout, the full width
                rows, kv = self.builder.max_rows, self.buckets.max_blocks
        arenas = self.executor.arenas
        arena = arenas.acquire()
        try:
            with self.tracer.span("pack", SCHEDULER_LANE, step=step_id):
                fi = self.builder.fill(step_id, step, arena, rows, kv, padded)
        except PackingError as error:
            arenas.release(arena)
            self._refuse_packing(step, error)
            return None
        except BaseException:
            arenas.release(arena)
            raise
        return fi, time.perf_counter() - started

    def _submit(self, step: ScheduledStep, fi: ForwardInput, pack_s: float, schedule_s: float) -> None:
        arenas, arena = self.executor.arenas, fi.arena
        try:
            with self.tracer.span("submit", SCHEDULER_LANE, step=fi.step_id):
                future = self.executor.submit(fi, lambda: arenas.release(arena))
        except BaseException:
            arenas.release(arena)
            raise
        path = "async" if self.pipeline.run_ahead and not step.synchronous else "sync"
        self.pipeline.push(InFlight(step, future, path, schedule_s, pack_s, fi if fi.mask_deferred else None))

    def _settle_masks(self, begin: bool = False) -> None:
        """Supply the grammar mask a step in flight owes: every step before it is read first, so each grammar
        has taken its token. ``begin``: where ``masks_beside_packing``, only start writing it on the mask thread
        (it is supplied before the next step is submitted, or before this one is read)."""
        owing = next((item for item in self.pipeline if item.fi is not None), None)
        if owing is None or owing.fi is None:
            return
        while self.pipeline.oldest() is not owing:
            self._complete_oldest()
        if not begin or not self.masks_beside_packing:
            self._supply_mask(owing)
        elif owing.masks is None:
            if self._mask_thread is None:
                self._mask_thread = MaskThread()
            owing.masks = self.builder.owed_masks(owing.step, owing.fi)
            owing.computing = self._mask_thread.start(owing.masks.compute, self.timeout_s,
                                                      f"the grammar masks of step {owing.fi.step_id}")

    def _supply_mask(self, item: InFlight) -> None:
        """Write ``item``'s grammar masks into its arena (or wait for the mask thread to have written them) and
        queue its sampling. A request whose grammar fails to write its mask ends with the error; its row allows
        every token, and its token is never read."""
        fi, started = item.fi, time.perf_counter()
        if fi is None:
            return
        pending, item.masks = item.masks, None
        with self.tracer.span("grammar masks", SCHEDULER_LANE, step=fi.step_id):
            for _ in range(len(item.step.seqs) + 1):
                try:
                    if pending is not None:
                        computed, pending = pending, None
                        self._wait_for_masks(item, fi)
                        masks = computed.finish()
                    else:
                        masks = self.builder.fill_owed_masks(item.step, fi)
                    break
                except PackingError as error:
                    for seq in error.seqs:
                        if not seq.is_finished:
                            self.finish(seq, FinishReason.error, str(error))
            else:
                masks = None
            item.fi = None
            item.future.supply_mask(masks)
        item.pack_s += time.perf_counter() - started

    def _wait_for_masks(self, item: InFlight, fi: ForwardInput) -> None:
        """Until the mask thread has computed ``item``'s grammar rows into ``fi``'s arena (bounded)."""
        if item.computing is not None and self._mask_thread is not None:
            self._mask_thread.result(item.computing, self.timeout_s, f"the grammar masks of step {fi.step_id}")
        item.computing = None

    def _refuse_packing(self, step: ScheduledStep, error: PackingError) -> None:
        """A step that could not be packed: its requests at fault fail, the others run in a later step."""
        self.scheduler.unschedule(step)
        for seq in error.seqs:
            if not seq.is_finished:
                self.finish(seq, FinishReason.error, str(error))

    def _complete_oldest(self) -> None:
        self._supply_mask(self.pipeline.oldest())  # a step that owes its mask is the oldest: its turn is now
        item = self.pipeline.pop()
        with self.tracer.span("wait for tokens", SCHEDULER_LANE):
            result = item.future.result(self.timeout_s)
        if result.handle is not None:
            self.tracer.step(result.handle, item.path)
        started = time.perf_counter()
        with self.tracer.span("postprocess", SCHEDULER_LANE):
            self._finished.extend(self.scheduler.postprocess(item.step, result.tokens, result.logprobs,
                                                             result.prompt_logprobs))
        host = HostTime(item.schedule_s * 1e6, item.pack_s * 1e6, (time.perf_counter() - started) * 1e6)
        self.metrics.record(result, item.path, item.step.sync_reasons, host, item.step.num_tokens)

    def _unblock(self) -> bool:
        """Nothing runs and nothing can be scheduled: fail the first waiting request, never hang."""
        seq = self.scheduler.waiting[0]
        self.finish(seq, FinishReason.error,
                    f"request needs {blocks_for(seq.num_tokens, self.builder.block_size)} KV blocks; "
                    f"the pool has {self.scheduler.blocks.num_free_blocks} free with nothing running")
        return True

    def cancel_in_flight(self) -> None:
        """Wait (bounded) for in-flight steps so the device no longer reads their inputs; drop their tokens."""
        while self.pipeline:
            item = self.pipeline.pop()
            if item.fi is not None:  # its sampling is not queued: let it sample anything, its tokens are dropped
                self._wait_for_masks(item, item.fi)  # the mask thread writes into its arena: it finishes first
                item.fi, item.masks = None, None
                item.future.supply_mask(None)
            item.future.result(self.timeout_s)

    def attach_tracer(self, tracer: Tracer) -> None:
        """Record host spans of the loop and device spans of every completed step into ``tracer``."""
        self.tracer = tracer
        self.executor.attach_tracer(tracer)

    def close(self) -> None:
        try:
            self.executor.close(self.timeout_s)
        finally:
            if self._mask_thread is not None:
                self._mask_thread.close(self.timeout_s)
