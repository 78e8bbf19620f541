"""Continuous batching: one ragged step of decode rows and prompt chunks, paged KV blocks, preemption by recompute.

Pure Python: no tensors, no device. Every sequence tracks the tokens whose KV is computed
(``num_computed_tokens``); a step feeds each of its rows the next tokens after those, so a decode
row feeds one token and a prompt row a whole prompt, or a chunk of it. With chunked prefill
(``SchedulerLimits.chunked_prefill``) a step spends a token budget: the decode rows first, then
chunks of the prompts in progress, then of waiting prompts; a row whose chunk does not reach its
last token samples nothing. Without it a step is all prompts (whole, first in line) or all decode.

Requests of one prompt (``add_group``: ``n`` choices) share its KV blocks: the first prefills the
prompt; the step in which it samples its first token hands the others its blocks (counted once
more each) and each recomputes only the prompt's last token, with its own sampling. A row that
would write into a block another sequence holds gets a copy of it first (copy on write): the
step copies the block on the device before its forward.

With async token handoff the scheduler runs one step ahead: a sequence may have sampled tokens
the host has not seen (``num_pending``). Such a sequence's next input comes from the device relay,
and a sequence that stops while a step is in flight has that step's token dropped and its blocks
returned. Only a row that samples makes a token pending, so the relay never feeds a row from a
step that sampled nothing for it.

Long: it is one policy, the ragged step's: admission, chunks, decode rows, copies on write, forks
and preemption decide each other's room in the same step, so they live together.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from corelib.engine.block_manager import BlockManager
from corelib.engine.sequence import MAX_LOGPROBS, FinishReason, Sequence, Status, TokenLogprobs
from corelib.engine.stops import StopChecker
from corelib.step.buckets import blocks_for
from corelib.step.forward_input import StepKind


@dataclass
class ScheduledStep:
    """The rows of one forward step and what the host knew when it was scheduled."""

    seqs: list[Sequence]
    starts: list[int]  # each row's first position fed
    query_lens: list[int]  # tokens each row feeds (1: a decode row)
    samples: list[bool]  # the row samples a token: its tokens reach the last one it has
    from_relay: list[bool]  # the row's last input token is still on the device
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, copy) KV blocks copied before the forward
    forked: list[Sequence] = field(default_factory=list)  # requests this step handed a prompt's blocks (n)
    synchronous: bool = False  # the host waits for this step's tokens before the next one
    sync_reasons: list[str] = field(default_factory=list)
    num_preempted: int = 0
    # Rows of requests asking for prompt logprobs: (row, first position, count), the positions whose logits
    # give the next prompt token's logprobs (the prompt's last position gives the first sample's: none here).
    prompt_logprobs: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def kind(self) -> StepKind:
        return StepKind.decode if not self.query_lens or max(self.query_lens) == 1 else StepKind.prefill

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def positions(self) -> list[int]:
        """Each row's last position fed (a decode row's one)."""
        return [start + q - 1 for start, q in zip(self.starts, self.query_lens, strict=True)]

    @property
    def seq_lens(self) -> list[int]:
        """Each row's tokens in the KV cache once this step has run."""
        return [start + q for start, q in zip(self.starts, self.query_lens, strict=True)]


class NoStep(enum.Enum):
    """Why the scheduler gives no step."""

    drain = "drain"  # it needs every in-flight step's tokens before it can decide the next step
    idle = "idle"  # nothing can run now: nothing is left, or what waits needs KV blocks first


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    chunked_prefill: bool = False  # prompts in chunks under the token budget, decode rows first
    share_prompt_blocks: bool = False  # the requests of one prompt share its blocks (no recurrent state)


SyncCheck = Callable[[list[Sequence]], list[str]]
NONFINITE_ERROR = ("the model's logits were not finite (NaN or inf) for this request: check the weights and the "
                   "model.* values (rms_norm_eps, rope_theta)")


@dataclass
class _Row:
    seq: Sequence
    tokens: int  # the chunk this row feeds


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
        self._forks: dict[int, list[Sequence]] = {}  # a prompt's first request -> the others, until it samples
        self.num_forked = 0
        self._carried: list[tuple[int, int]] = []  # copies on write of a step taken back: the next step makes them

    # ------------------------------------------------------------------ admission
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        seq.ends = self.stops.facts_of(seq)  # once per request: the per-token check reads it
        self.blocks.prepare(seq)  # its prompt's blocks' keys now, not in the step that admits it
        self.waiting.append(seq)

    def add_group(self, seqs: list[Sequence]) -> None:
        """Requests of one prompt: the first prefills it, the others take its blocks once it has."""
        first, *others = seqs
        self.add(first)
        if not others:
            return
        if not self.limits.share_prompt_blocks:
            for seq in others:
                self.add(seq)
            return
        for seq in others:
            seq.status = Status.WAITING
        self._forks[first.seq_id] = others

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._forks)

    def unfinished(self) -> list[Sequence]:
        """Every sequence not finished: running, waiting, and waiting for its prompt's first request."""
        return [*self.running, *self.waiting, *(seq for group in self._forks.values() for seq in group)]

    def schedule(self, in_flight: bool, sync_check: SyncCheck) -> ScheduledStep | NoStep:
        """The next step, or why there is none."""
        if self.limits.chunked_prefill:
            decode, prompts = self._running_rows()
            budget = self.limits.max_num_batched_tokens - len(decode)
            admitted = self._choose_prompts(budget - sum(s.num_uncomputed_tokens for s in prompts), chunked=True)
        else:
            decode, prompts = [], []
            admitted = self._choose_prompts(self.limits.max_num_batched_tokens, chunked=False)
            if not admitted:
                decode, _ = self._running_rows()  # without chunks a running sequence has its prompt computed
        candidates = [*decode, *prompts, *(seq for seq, _ in admitted)]
        if not candidates:
            return NoStep.drain if in_flight else NoStep.idle
        reasons = sync_check(candidates)
        if in_flight and (reasons or self._needs_preemption(decode)):
            return NoStep.drain
        step = self._build(decode, prompts, admitted)
        if not step.seqs and not step.num_preempted:
            return NoStep.idle
        step.synchronous = bool(reasons)
        step.sync_reasons = reasons
        return step

    def _choose_prompts(self, budget: int, chunked: bool) -> list[tuple[Sequence, int]]:
        """Waiting sequences to admit, first in line, with the tokens each feeds now."""
        chosen: list[tuple[Sequence, int]] = []
        blocks = 0
        for seq in self.waiting:
            if len(self.running) + len(chosen) >= self.limits.max_num_seqs:
                break
            if len(chosen) >= len(self._free_state_indices):
                break
            if chunked and budget <= 0:
                break  # no token of the budget left for it: its cached prefix need not be looked up now
            cached = self.blocks.cached_prefix_tokens(seq)
            tokens = seq.num_tokens - cached
            if chunked:
                tokens = min(tokens, budget)
            elif chosen and tokens > budget:
                break
            if tokens <= 0:
                break
            need = blocks_for(cached + tokens, self.blocks.block_size)  # cached blocks may be free ones too
            if blocks + need > self.blocks.num_free_blocks:
                break
            chosen.append((seq, tokens))
            budget -= tokens
            blocks += need
        return chosen

    def _running_rows(self) -> tuple[list[Sequence], list[Sequence]]:
        """The running sequences that go on: (those that decode, those within their prompt), in order.

        A sequence goes on until it has ``max_tokens`` outputs or the model's length, counting the
        tokens still in flight; ``num_uncomputed_tokens`` is read inline: this runs for every row of every step.
        """
        decode: list[Sequence] = []
        prompts: list[Sequence] = []
        max_len, running = self.limits.max_model_len, Status.RUNNING
        for seq in self.running:
            scheduled = len(seq.output_token_ids) + seq.num_pending  # outputs once every step in flight is read
            max_tokens = seq.sampling.max_tokens  # None: to the model's length, checked below
            if seq.status is not running or (max_tokens is not None and scheduled >= max_tokens):
                continue
            known = seq.num_prompt_tokens + scheduled
            if known >= max_len:
                continue
            uncomputed = known - seq.num_computed_tokens
            if uncomputed == 1:
                decode.append(seq)
            elif uncomputed > 1:
                prompts.append(seq)
        return decode, prompts

    def _needs_preemption(self, decode: list[Sequence]) -> bool:
        free = self.blocks.num_free_blocks
        if free >= len(decode):
            # A decode row takes at most one block (its token's slot, or a copy of the shared block it
            # writes into), and every earlier step reserved its own: there are enough.
            return False
        missing = sum(self._blocks_wanted(seq) for seq in decode)
        return missing > free

    def _blocks_wanted(self, seq: Sequence) -> int:
        """Blocks a decode row takes from the pool: for its token's slot, and for a copy of a shared block."""
        copy = self.blocks.writes_shared_block(seq, seq.num_computed_tokens)
        return self.blocks.num_missing(seq, seq.num_scheduled_tokens) + int(copy)

    def _build(self, decode: list[Sequence], prompts: list[Sequence],
               admitted: list[tuple[Sequence, int]]) -> ScheduledStep:
        step = ScheduledStep([], [], [], [], [], self._carried)
        self._carried = []
        self._add_decode_rows(step, decode)
        rows: list[_Row] = []
        budget = self.limits.max_num_batched_tokens - len(step.seqs)
        for seq in prompts:  # prompts in progress, in the order they were admitted
            if seq.status is not Status.RUNNING:
                continue  # preempted above to make room for a decode row
            tokens = self._fit_chunk(seq, min(seq.num_uncomputed_tokens, budget))
            if tokens:
                rows.append(_Row(seq, tokens))
                budget -= tokens
        for seq, planned in admitted:
            if seq.status is not Status.WAITING or seq not in self.waiting:
                continue
            tokens = self._admit(seq, planned)
            if not tokens:
                break
            rows.append(_Row(seq, tokens))
        self._add_rows(step, rows)
        return step

    def _add_decode_rows(self, step: ScheduledStep, decode: list[Sequence]) -> None:
        """The decode rows, first: each feeds the one token it sampled last (its KV slot grown when the
        row reaches a new block, a shared block copied first), and samples the next.

        The loop every decode step runs for every row, so it reads the fields itself: most rows of
        most steps have their slot already and share no block.
        """
        blocks = self.blocks
        size, caching, refs, forks = blocks.block_size, blocks.prefix_caching, blocks.ref_counts, self._forks
        seqs, starts, lens, samples, relay = step.seqs, step.starts, step.query_lens, step.samples, step.from_relay
        queue = deque(decode)
        first = len(seqs)
        # Rows that key a block this step (prefix caching): rows decoding in step cross block boundaries together,
        # and keying all of them at once put a millisecond of host work on one step in every block_size at bs
        # 128, a gap on the device. The rest key theirs on the next steps: all within half a block's steps.
        keys_left = -(-2 * len(decode) // size)
        while queue:
            seq = queue.popleft()
            start = seq.num_computed_tokens  # the position fed: its token needs its KV slot
            table = seq.block_table
            index, have = start // size, len(table)
            shared = index < have and refs[table[index]] > 1
            if shared or index >= have:
                while self._blocks_wanted(seq) > blocks.num_free_blocks:
                    victim = queue.pop() if queue else self._latest_other(seq)
                    self._preempt(victim)
                    step.num_preempted += 1
                    if victim is seq:
                        break
                if seq.status is not Status.RUNNING:
                    continue
                # Asked again: the victim may have been the sequence that shared the block, which is then ours alone.
                if index < len(table) and refs[table[index]] > 1:
                    step.copies.append(blocks.copy_on_write(seq, start))
                blocks.append(seq, start + 1)
            pending = seq.num_pending
            seqs.append(seq)
            starts.append(start)
            relay.append(pending > 0)
            seq.num_computed_tokens = start + 1
            # Prefix caching keys a block once the host knows its every token: at most one in a few steps a row.
            if caching and keys_left and min(start + 1, seq.num_tokens) // size > seq.num_registered_blocks:
                blocks.register(seq, start + 1)
                keys_left -= 1
            if forks and not pending and seq.seq_id in forks and not seq.output_token_ids:
                step.forked += self._fork(seq, forks.pop(seq.seq_id))
            seq.num_pending = pending + 1
        added = len(seqs) - first  # each feeds one token and samples
        lens += [1] * added
        samples += [True] * added

    def _latest_other(self, seq: Sequence) -> Sequence:
        """The victim once no later decode row is left: the latest prompt in progress, else ``seq`` itself."""
        for other in reversed(self.running):
            if other is not seq and other.num_uncomputed_tokens > 1 and not other.num_pending:
                return other
        return seq

    def _fit_chunk(self, seq: Sequence, tokens: int) -> int:
        """Grow ``seq``'s blocks for a chunk of up to ``tokens``; the chunk the free blocks allow."""
        if tokens <= 0:
            return 0
        size = self.blocks.block_size
        have = len(seq.block_table) * size + self.blocks.num_free_blocks * size
        tokens = min(tokens, have - seq.num_computed_tokens)
        if tokens <= 0:
            return 0
        self.blocks.append(seq, seq.num_computed_tokens + tokens)
        return tokens

    def _admit(self, seq: Sequence, planned: int) -> int:
        """Start ``seq``: its cached prefix, then blocks for its first tokens (``planned`` of them when
        chunked, else the rest of them); returns the tokens it feeds now (0: it does not fit)."""
        if not self._free_state_indices:
            return 0
        cached = self.blocks.allocate_prefix(seq)
        tokens = seq.num_tokens - cached
        if self.limits.chunked_prefill:
            tokens = min(tokens, planned)
        if not self.blocks.can_append(seq, cached + tokens):
            self.blocks.free(seq)
            return 0
        self.waiting.remove(seq)
        self.blocks.append(seq, cached + tokens)
        self.blocks.count_lookup(seq, cached)
        seq.state_index = self._free_state_indices.popleft()
        seq.status = Status.RUNNING
        seq.num_computed_tokens = cached
        self.running.append(seq)
        return tokens

    def _add_rows(self, step: ScheduledStep, rows: list[_Row]) -> None:
        """Prompt rows, after the decode rows: a row samples when its chunk reaches its last token."""
        for row in rows:
            seq = row.seq
            start = seq.num_computed_tokens
            samples = start + row.tokens == seq.num_scheduled_tokens
            step.seqs.append(seq)
            step.starts.append(start)
            step.query_lens.append(row.tokens)
            step.samples.append(samples)
            step.from_relay.append(samples and seq.num_pending > 0)
            if seq.sampling.prompt_logprobs is not None:
                first = max(start, len(seq.prompt_logprobs))  # a prompt computed again after preemption has some
                count = min(start + row.tokens, seq.num_prompt_tokens - 1) - first
                if count > 0:
                    step.prompt_logprobs.append((len(step.seqs) - 1, first, count))
            seq.num_computed_tokens = start + row.tokens
            self.blocks.register(seq, seq.num_computed_tokens)
            if samples:
                if seq.seq_id in self._forks and not seq.output_token_ids and not seq.num_pending:
                    step.forked += self._fork(seq, self._forks.pop(seq.seq_id))
                seq.num_pending += 1

    def _fork(self, first: Sequence, others: list[Sequence]) -> list[Sequence]:
        """``first`` has its prompt's KV (this step writes its last): the others take its blocks and recompute
        only the prompt's last token; one that finds no room waits and prefills on its own. Returns those
        that took the blocks."""
        shared = len(first.prompt_token_ids) - 1
        forked: list[Sequence] = []
        for seq in others:
            if len(self.running) >= self.limits.max_num_seqs or not self._free_state_indices:
                self.add(seq)
                continue
            self.blocks.share(first, seq, shared)
            seq.state_index = self._free_state_indices.popleft()
            seq.status = Status.RUNNING
            seq.num_computed_tokens = shared
            self.running.append(seq)
            self.num_forked += 1
            forked.append(seq)
        return forked

    def unschedule(self, step: ScheduledStep) -> None:
        """Take back a step that was never submitted: each row feeds the same tokens again in a later step.

        Rows keep their blocks (the next step needs them), but the blocks this step keyed for the
        prefix cache hold nothing yet and lose their keys, and a row that sampled makes no token
        pending; its copies on write are made by the next step. Requests handed a prompt's blocks by
        this step (``n``) wait and prefill on their own.
        """
        for seq, start, samples in zip(step.seqs, step.starts, step.samples, strict=True):
            if samples:
                seq.num_pending -= 1
            seq.num_computed_tokens = start
            self.blocks.unregister(seq, start)
        # A row that was given its own copy of a shared block already writes there: the next step
        # makes the copy before its forward (a copy whose row finishes meanwhile copies into a
        # block that is free again, which nothing reads).
        self._carried = step.copies + self._carried
        again = list(step.forked)
        if not self.limits.chunked_prefill:  # a prompt is fed whole: one taken back waits to be admitted again
            again += [seq for seq in step.seqs if seq.num_uncomputed_tokens > 1]
        for seq in reversed(again):
            if seq.status is Status.RUNNING and not seq.num_pending:
                self._preempt(seq)
                self.num_preemptions -= 1  # not for want of blocks

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: drop the KV blocks and put the sequence first in line."""
        if seq.num_pending:
            raise RuntimeError(f"cannot preempt {seq.request_id} while its tokens are in flight")
        self.blocks.free(seq)
        self._release_state_index(seq)
        self.running.remove(seq)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ------------------------------------------------------------------ results
    def postprocess(self, step: ScheduledStep, tokens: Iterable[int], logprobs: list[list[float]] | None = None,
                    prompt_logprobs: list[list[float]] | None = None) -> list[Sequence]:
        """Take one step's sampled tokens (one per row; a row that sampled nothing has its token
        ignored) and, from a step that computed them, each row's logprobs and the prompt logprobs of its
        ``step.prompt_logprobs`` positions, in that order; returns the sequences that finished."""
        if step.prompt_logprobs and prompt_logprobs is not None:
            _take_prompt_logprobs(step, prompt_logprobs)
        now = time.perf_counter()
        finished: list[Sequence] = []
        may_stop, stop_reason, done = self.stops.may_stop, self.stops.stop_reason, Status.FINISHED
        for row, (seq, samples, token) in enumerate(zip(step.seqs, step.samples, tokens, strict=True)):
            if not samples:
                continue  # a chunk short of the prompt's end: its row's token means nothing
            seq.num_pending -= 1
            if seq.status is done:
                continue  # a token sampled after the stop, while the stop was not yet known
            if token < 0:
                self.finish(seq, FinishReason.error, now, error=NONFINITE_ERROR)
                finished.append(seq)
                continue
            seq.output_token_ids.append(token)
            if seq.sampling.logprobs is not None and logprobs is not None:
                seq.logprobs.append(_token_logprobs(token, logprobs[row], seq.sampling.logprobs))
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.grammar is not None and self._grammar_ends(seq, token, now):
                finished.append(seq)
                continue
            if not may_stop(seq, token):
                continue  # most rows of most steps: no stop id, no text check, below the length limit
            reason = stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason, now)
                finished.append(seq)
        return finished

    def _grammar_ends(self, seq: Sequence, token: int, now: float) -> bool:
        """Structured output: the grammar takes ``token``; whether that ended ``seq`` (its output complete, or a
        token the grammar refuses: an error)."""
        grammar = seq.grammar
        verdict = None if grammar is None else grammar.advance(token)
        if verdict is None:
            return False
        if verdict == "done":
            self.finish(seq, FinishReason.stop, now)
        else:
            self.finish(seq, FinishReason.error, now, error=verdict)
        return True

    def finish(self, seq: Sequence, reason: FinishReason, now: float | None = None, error: str | None = None) -> None:
        """End a sequence: its blocks and state index go back at once (later device work is stream-ordered)."""
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.error = error
        seq.finish_time = time.perf_counter() if now is None else now
        if reason is not FinishReason.error:
            self.blocks.register(seq, seq.num_computed_tokens)  # blocks whose keying was put off (decode rows)
        self.blocks.free(seq)
        self._release_state_index(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            for first, group in list(self._forks.items()):
                if seq in group:
                    group.remove(seq)
                    if not group:
                        del self._forks[first]
        for other in self._forks.pop(seq.seq_id, []):  # ended before it could share its prompt
            self.add(other)

    def abort_all(self, reason: FinishReason, error: str | None = None) -> list[Sequence]:
        """Finish every unfinished sequence (shutdown or a fatal device error)."""
        victims = self.unfinished()
        for seq in victims:
            self.finish(seq, reason, error=error)
        return victims

    def _release_state_index(self, seq: Sequence) -> None:
        if seq.state_index is not None:
            self._free_state_indices.append(seq.state_index)
            seq.state_index = None


def _take_prompt_logprobs(step: ScheduledStep, values: list[list[float]]) -> None:
    """Each prompt position's logprobs (device rows, as :func:`_token_logprobs` reads them) into its request, once:
    a position computed again (after preemption) keeps what it had."""
    at = 0
    for row, first, count in step.prompt_logprobs:
        seq = step.seqs[row]
        have, prompt, wanted = seq.prompt_logprobs, seq.prompt_token_ids, seq.sampling.prompt_logprobs or 0
        for position in range(max(first, len(have)), first + count):
            if position != len(have):
                break  # an earlier chunk's are missing: nothing after them can be placed
            have.append(_token_logprobs(prompt[position + 1], values[at + position - first], wanted))
        at += count


def _token_logprobs(token: int, row: list[float], count: int) -> TokenLogprobs:
    """A row of the device's logprobs (the token's, its rank, then the top values, then their ids) as ``count``
    alternatives."""
    top = [(int(row[2 + MAX_LOGPROBS + i]), row[2 + i]) for i in range(count)]
    return TokenLogprobs(token, row[0], tuple(top), int(row[1]))
