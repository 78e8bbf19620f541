"""Continuous batching: FIFO admission by free KV blocks, decode batches, preemption by recompute.

Pure Python: no tensors, no device. With async token handoff the scheduler runs one step
ahead: a sequence may have sampled tokens the host has not seen (``num_pending``). Such a
sequence's next input comes from the device relay, and a sequence that stops while a step
is in flight has that step's token dropped and its blocks returned.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from corelib.engine.block_manager import BlockManager, blocks_for
from corelib.engine.sequence import FinishReason, Sequence, Status
from corelib.engine.stops import StopChecker
from corelib.step.forward_input import StepKind


@dataclass
class ScheduledStep:
    """The sequences of one forward step and what the host knew when it was scheduled."""

    kind: StepKind
    seqs: list[Sequence]
    positions: list[int]  # decode: the position fed for each sequence
    from_relay: list[bool]  # decode: the input token is still on the device
    synchronous: bool = False  # the host waits for this step's tokens before the next one
    sync_reasons: list[str] = field(default_factory=list)
    num_preempted: int = 0


class NoStep(enum.Enum):
    """Why the scheduler gives no step."""

    drain = "drain"  # it needs every in-flight step's tokens before it can decide the next step
    idle = "idle"  # nothing can run now: nothing is left, or what waits needs KV blocks first


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


SyncCheck = Callable[[list[Sequence]], list[str]]
NONFINITE_ERROR = ("the model's logits were not finite (NaN or inf) for this request: check the weights and the "
                   "model.* values (rms_norm_eps, rope_theta)")


class Scheduler:
    """Decides each step's batch. The engine calls schedule, then postprocess with the tokens."""

    def __init__(
        self,
        limits: SchedulerLimits,
        blocks: BlockManager,
        num_states: int,
        stops: StopChecker,
    ) -> None:
        self.limits = limits
        self.stops = stops
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_state_indices: deque[int] = deque(range(num_states))
        self.num_preemptions = 0

    # ------------------------------------------------------------------ admission
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, in_flight: bool, sync_check: SyncCheck) -> ScheduledStep | NoStep:
        """The next step, or why there is none."""
        chosen = self._choose_prefill()
        kind = StepKind.prefill if chosen else StepKind.decode
        if not chosen:
            chosen = [seq for seq in self.running if self._can_continue(seq)]
        if not chosen:
            return NoStep.drain if in_flight else NoStep.idle
        reasons = sync_check(chosen)
        if in_flight and (reasons or (kind is StepKind.decode and self._needs_preemption(chosen))):
            return NoStep.drain
        step = self._admit(chosen) if kind is StepKind.prefill else self._decode(chosen)
        step.synchronous = bool(reasons)
        step.sync_reasons = reasons
        return step

    def _choose_prefill(self) -> list[Sequence]:
        chosen: list[Sequence] = []
        tokens = blocks = 0
        for seq in self.waiting:
            if len(self.running) + len(chosen) >= self.limits.max_num_seqs:
                break
            if len(chosen) >= len(self._free_state_indices):
                break
            if chosen and tokens + seq.num_tokens > self.limits.max_num_batched_tokens:
                break
            need = blocks_for(seq.num_tokens, self.blocks.block_size)
            if blocks + need > self.blocks.num_free_blocks:
                break
            chosen.append(seq)
            tokens += seq.num_tokens
            blocks += need
        return chosen

    def _admit(self, seqs: list[Sequence]) -> ScheduledStep:
        for seq in seqs:
            self.waiting.remove(seq)
            self.blocks.allocate(seq, seq.num_tokens)
            seq.state_index = self._free_state_indices.popleft()
            seq.status = Status.RUNNING
            seq.num_pending += 1
            self.running.append(seq)
        return ScheduledStep(StepKind.prefill, list(seqs), [], [])

    def _can_continue(self, seq: Sequence) -> bool:
        return (
            seq.status is Status.RUNNING
            and len(seq.output_token_ids) + seq.num_pending < seq.sampling.max_tokens
            and seq.num_scheduled_tokens < self.limits.max_model_len
        )

    def _needs_preemption(self, seqs: list[Sequence]) -> bool:
        size = self.blocks.block_size
        missing = 0
        for seq in seqs:
            have = len(seq.block_table) * size
            need = seq.num_scheduled_tokens
            if need > have:
                missing += -(-(need - have) // size)
        return missing > self.blocks.num_free_blocks

    def _decode(self, candidates: list[Sequence]) -> ScheduledStep:
        scheduled: list[Sequence] = []
        positions: list[int] = []
        from_relay: list[bool] = []
        preempted = 0
        size = self.blocks.block_size
        queue = deque(candidates)
        while queue:
            seq = queue.popleft()
            need = seq.num_scheduled_tokens  # the token fed this step needs its KV slot
            if need > len(seq.block_table) * size:
                while not self.blocks.can_append(seq, need):
                    victim = queue.pop() if queue else seq
                    self._preempt(victim)
                    preempted += 1
                    if victim is seq:
                        break
                else:
                    self.blocks.append(seq, need)
                if seq.status is not Status.RUNNING:
                    continue
            scheduled.append(seq)
            positions.append(need - 1)
            from_relay.append(seq.num_pending > 0)
            seq.num_pending += 1
        return ScheduledStep(StepKind.decode, scheduled, positions, from_relay, num_preempted=preempted)

    def unschedule(self, step: ScheduledStep) -> None:
        """Take back a step that was never submitted: its sequences are as they were before it was scheduled.

        A prefill's sequences wait again, first in line, their blocks and state indices back (they
        had computed nothing); a decode's keep their blocks (the next step needs them) and feed the
        same position again.
        """
        for seq in step.seqs:
            seq.num_pending -= 1
        if step.kind is StepKind.decode:
            return
        for seq in reversed(step.seqs):
            if seq.is_finished:
                continue
            self.blocks.free(seq)
            self._release_state_index(seq)
            self.running.remove(seq)
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: drop the KV blocks and put the sequence first in line."""
        if seq.num_pending:
            raise RuntimeError(f"cannot preempt {seq.request_id} while its tokens are in flight")
        self.blocks.free(seq)
        self._release_state_index(seq)
        self.running.remove(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ------------------------------------------------------------------ results
    def postprocess(self, step: ScheduledStep, tokens: Iterable[int]) -> list[Sequence]:
        """Take one step's sampled tokens; returns the sequences that finished."""
        now = time.perf_counter()
        finished: list[Sequence] = []
        for seq, token in zip(step.seqs, tokens, strict=True):
            seq.num_pending -= 1
            if seq.is_finished:
                continue  # a token sampled after the stop, while the stop was not yet known
            if token < 0:
                self.finish(seq, FinishReason.error, now, error=NONFINITE_ERROR)
                finished.append(seq)
                continue
            seq.output_token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self.stops.stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason, now)
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence, reason: FinishReason, now: float | None = None, error: str | None = None) -> None:
        """End a sequence: its blocks and state index go back at once (later device work is stream-ordered)."""
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.error = error
        seq.finish_time = time.perf_counter() if now is None else now
        self.blocks.free(seq)
        self._release_state_index(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def abort_all(self, reason: FinishReason, error: str | None = None) -> list[Sequence]:
        """Finish every unfinished sequence (shutdown or a fatal device error)."""
        victims = [*self.running, *self.waiting]
        for seq in victims:
            self.finish(seq, reason, error=error)
        return victims

    def _release_state_index(self, seq: Sequence) -> None:
        if seq.state_index is not None:
            self._free_state_indices.append(seq.state_index)
            seq.state_index = None
