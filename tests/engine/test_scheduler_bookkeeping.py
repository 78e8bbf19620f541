"""The bookkeeping behind continuous batching, one mistake per test: blocks, state indices, queues, counts.

Pure Python and milliseconds: each test names what a wrong free, append, preemption or finish
would leave behind, so a slip shows here rather than only as different tokens in a long run.
"""

from __future__ import annotations

import pytest

from corelib.engine.block_manager import NULL_BLOCK, BlockManager
from corelib.engine.scheduler import NoStep, ScheduledStep, Scheduler, SchedulerLimits
from corelib.engine.sequence import FinishReason, SamplingParams, Sequence, Status
from corelib.engine.stops import StopChecker
from corelib.step.forward_input import StepKind

BLOCK = 4


def seq(i: int, prompt_len: int = 4, max_tokens: int = 32) -> Sequence:
    return Sequence(i, f"r{i}", list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens))


def scheduler(num_blocks: int = 32, max_seqs: int = 4, max_len: int = 64, num_states: int | None = None) -> Scheduler:
    return Scheduler(SchedulerLimits(max_seqs, 256, max_len), BlockManager(num_blocks, BLOCK),
                     max_seqs if num_states is None else num_states, StopChecker(max_len, frozenset({1})))


def step(s: Scheduler) -> ScheduledStep:
    out = s.schedule(in_flight=False, sync_check=lambda seqs: [])
    assert isinstance(out, ScheduledStep), out
    return out


def advance(s: Scheduler, token: int = 50) -> ScheduledStep:
    out = step(s)
    s.postprocess(out, [token] * len(out.seqs))
    return out


# ---------------------------------------------------------------------- block manager
@pytest.mark.parametrize(("tokens", "blocks"), [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_append_takes_exactly_the_blocks_the_tokens_need(tokens: int, blocks: int) -> None:
    bm = BlockManager(8, BLOCK)
    a = seq(0)
    bm.append(a, tokens)
    assert len(a.block_table) == blocks and bm.num_free_blocks == 7 - blocks
    bm.append(a, tokens)  # nothing more for the same count
    assert len(a.block_table) == blocks


def test_append_grows_a_table_from_where_it_ends() -> None:
    bm = BlockManager(8, BLOCK)
    a = seq(0)
    bm.append(a, 4)
    first = list(a.block_table)
    bm.append(a, 5)
    assert a.block_table[:1] == first and len(a.block_table) == 2 and len(set(a.block_table)) == 2


def test_blocks_are_never_the_null_block_nor_held_twice() -> None:
    bm = BlockManager(7, BLOCK)
    a, b = seq(0), seq(1)
    bm.append(a, 12)
    bm.append(b, 12)
    held = a.block_table + b.block_table
    assert NULL_BLOCK not in held and len(set(held)) == len(held) == 6 and bm.num_free_blocks == 0


def test_free_returns_every_block_and_marks_the_table_new() -> None:
    bm = BlockManager(8, BLOCK)
    a = seq(0)
    bm.append(a, 10)
    epoch = a.blocks_epoch
    bm.free(a)
    assert bm.num_free_blocks == 7 and a.block_table == []
    assert a.blocks_epoch == epoch + 1, "a table cached by its epoch (the packer's) must start over"
    b = seq(1)
    bm.append(b, 28)  # every block is usable again
    assert len(b.block_table) == 7


def test_can_append_agrees_with_append() -> None:
    bm = BlockManager(4, BLOCK)  # 3 usable
    a = seq(0)
    assert bm.can_append(a, 12) and not bm.can_append(a, 13)
    with pytest.raises(RuntimeError, match="needs 4 more KV blocks, 3 are free"):
        bm.append(a, 13)


# ---------------------------------------------------------------------- admission and state indices
def test_admission_gives_each_sequence_its_own_state_index_and_blocks() -> None:
    s = scheduler()
    seqs = [seq(i, prompt_len=5) for i in range(3)]
    for q in seqs:
        s.add(q)
    prefill = step(s)
    assert prefill.kind is StepKind.prefill and prefill.seqs == seqs
    assert sorted(q.state_index for q in seqs if q.state_index is not None) == [0, 1, 2]
    assert all(len(q.block_table) == 2 for q in seqs) and s.blocks.num_free_blocks == 31 - 6
    assert all(q.status is Status.RUNNING and q.num_pending == 1 for q in seqs)
    assert s.running == seqs and not s.waiting


@pytest.mark.parametrize(("max_seqs", "num_states"), [(2, 2), (4, 2)])
def test_no_more_sequences_run_than_there_are_state_indices(max_seqs: int, num_states: int) -> None:
    s = scheduler(max_seqs=max_seqs, num_states=num_states)
    for i in range(3):
        s.add(seq(i))
    assert [q.seq_id for q in step(s).seqs] == [0, 1]
    assert [q.seq_id for q in s.waiting] == [2]


# ---------------------------------------------------------------------- finish
def test_finishing_a_running_sequence_returns_its_blocks_and_state_index() -> None:
    s = scheduler(max_seqs=2)
    a, b = seq(0), seq(1)
    s.add(a)
    s.add(b)
    advance(s)
    index = a.state_index
    s.finish(a, FinishReason.abort, error="gone")
    assert a.status is Status.FINISHED and a.finish_reason is FinishReason.abort and a.error == "gone"
    assert a.finish_time is not None
    assert a.block_table == [] and a.state_index is None and a not in s.running
    assert s.blocks.num_free_blocks == 31 - len(b.block_table)
    c = seq(2)
    s.add(c)
    advance(s)
    assert c.state_index == index, "the freed state index (the only one) is handed out again"


def test_finishing_a_waiting_sequence_takes_it_out_of_the_queue() -> None:
    s = scheduler(max_seqs=1)
    a, b = seq(0), seq(1)
    s.add(a)
    s.add(b)
    advance(s)
    s.finish(b, FinishReason.abort)
    assert not s.waiting and b.status is Status.FINISHED and s.blocks.num_free_blocks == 31 - 1


def test_abort_all_finishes_everything_and_frees_everything() -> None:
    s = scheduler(max_seqs=2)
    seqs = [seq(i) for i in range(3)]
    for q in seqs:
        s.add(q)
    advance(s)
    assert s.abort_all(FinishReason.abort) == [seqs[0], seqs[1], seqs[2]]
    assert not s.has_unfinished and s.blocks.num_free_blocks == 31
    assert all(q.is_finished and q.state_index is None for q in seqs)
    assert s.schedule(in_flight=False, sync_check=lambda seqs: []) is NoStep.idle


def test_a_stop_finishes_the_sequence_and_frees_it_at_once() -> None:
    s = scheduler()
    a = seq(0)
    s.add(a)
    finished = s.postprocess(step(s), [1])  # the end-of-sequence id
    assert finished == [a] and a.finish_reason is FinishReason.stop
    assert a.block_table == [] and a.state_index is None and not s.running and s.blocks.num_free_blocks == 31


def test_a_non_finite_token_fails_only_its_request() -> None:
    s = scheduler()
    a, b = seq(0), seq(1)
    s.add(a)
    s.add(b)
    finished = s.postprocess(step(s), [-1, 7])
    assert finished == [a] and a.finish_reason is FinishReason.error and "not finite" in (a.error or "")
    assert b.output_token_ids == [7] and b.status is Status.RUNNING


# ---------------------------------------------------------------------- preemption
def filled(num_blocks: int) -> tuple[Scheduler, Sequence, Sequence]:
    """Two sequences of one full block each, decoding until the pool runs out."""
    s = scheduler(num_blocks=num_blocks)
    a, b = seq(0), seq(1)
    s.add(a)
    s.add(b)
    advance(s)
    return s, a, b


def test_preemption_takes_the_latest_sequence_first_and_recomputes_it_later() -> None:
    s, a, b = filled(num_blocks=4)  # 3 usable: a and b hold one each
    index = b.state_index
    decode = advance(s)  # both need a second block: only one is free, so b makes room for a
    assert decode.num_preempted == 1 and decode.seqs == [a]
    assert s.num_preemptions == 1
    assert b.status is Status.WAITING and s.waiting[0] is b and b not in s.running
    assert b.block_table == [] and b.state_index is None and b.output_token_ids == [50]
    assert len(a.block_table) == 2 and s.blocks.num_free_blocks == 1
    assert index not in (a.state_index, None)
    s.finish(a, FinishReason.abort)
    again = step(s)  # b comes back first, as a prefill of its prompt and its output so far
    assert again.kind is StepKind.prefill and again.seqs == [b] and b.state_index is not None
    assert len(b.block_table) == 2  # 4 prompt tokens + 1 output


def test_the_later_sequence_makes_room_for_the_earlier_one() -> None:
    s, a, b = filled(num_blocks=3)  # 2 usable: a's second block must come from b
    decode = advance(s)
    assert decode.num_preempted == 1 and decode.seqs == [a] and len(a.block_table) == 2
    assert list(s.waiting) == [b] and s.running == [a]


def test_a_sequence_with_no_one_to_take_from_preempts_itself() -> None:
    s = scheduler(num_blocks=2)  # one usable block: the prompt fits, the first output's KV does not
    a = seq(0)
    s.add(a)
    advance(s)
    decode = advance(s)
    assert decode.num_preempted == 1 and decode.seqs == [] and s.num_preemptions == 1
    assert list(s.waiting) == [a] and not s.running and a.block_table == [] and a.state_index is None
    assert s.blocks.num_free_blocks == 1
    assert s.schedule(in_flight=False, sync_check=lambda seqs: []) is NoStep.idle  # 5 tokens need 2 blocks


def test_victims_are_taken_from_the_latest_sequence_backwards() -> None:
    s = scheduler(num_blocks=4)  # 3 usable, one per sequence: none is left for a second block
    seqs = [seq(i) for i in range(3)]
    for q in seqs:
        s.add(q)
    advance(s)
    decode = advance(s)  # a takes c's block; b then finds nobody behind it and preempts itself
    assert decode.seqs == [seqs[0]] and decode.num_preempted == 2
    assert [q.seq_id for q in s.waiting] == [1, 2], "the earlier of the preempted goes first again"


def test_a_preempted_sequence_goes_back_ahead_of_those_still_waiting() -> None:
    s = scheduler(num_blocks=4, max_seqs=2)  # 3 usable blocks; at most 2 sequences run
    a, b, c = seq(0), seq(1), seq(2)
    for q in (a, b, c):
        s.add(q)
    advance(s)  # a and b run; c waits for a place
    assert list(s.waiting) == [c]
    advance(s)  # b makes room for a's second block
    assert list(s.waiting) == [b, c]


# ---------------------------------------------------------------------- running ahead near a full pool
def in_flight_prefill(num_blocks: int) -> tuple[Scheduler, Sequence, Sequence]:
    """Two prompts of one full block each, their prefill still on the device: both next need a second block."""
    s = scheduler(num_blocks=num_blocks)
    a, b = seq(0), seq(1)
    s.add(a)
    s.add(b)
    step(s)
    assert a.num_pending == b.num_pending == 1
    return s, a, b


def test_running_ahead_takes_the_last_free_blocks_when_they_are_exactly_enough() -> None:
    s, a, b = in_flight_prefill(num_blocks=5)  # 4 usable: 2 held, 2 free, one more each
    decode = s.schedule(in_flight=True, sync_check=lambda seqs: [])
    assert isinstance(decode, ScheduledStep), f"exactly enough free blocks, yet {decode!r}"
    assert decode.seqs == [a, b] and decode.from_relay == [True, True] and decode.num_preempted == 0
    assert s.blocks.num_free_blocks == 0


@pytest.mark.parametrize("num_blocks", [3, 4])  # 0 or 1 free where 2 are needed
def test_running_ahead_waits_for_the_tokens_rather_than_preempt_a_sequence_in_flight(num_blocks: int) -> None:
    s, a, b = in_flight_prefill(num_blocks)
    free = s.blocks.num_free_blocks
    assert s.schedule(in_flight=True, sync_check=lambda seqs: []) is NoStep.drain
    assert s.running == [a, b] and s.num_preemptions == 0 and s.blocks.num_free_blocks == free
    assert a.num_pending == b.num_pending == 1, "nothing was scheduled"


def test_a_step_taken_back_leaves_its_copies_on_write_to_the_next_step() -> None:
    s = Scheduler(SchedulerLimits(4, 256, 64, share_prompt_blocks=True), BlockManager(32, BLOCK), 4,
                  StopChecker(64, frozenset({1})))
    first, second = seq(0, prompt_len=6), seq(1, prompt_len=6)
    s.add_group([first, second])
    advance(s)  # the first prefills the prompt; the second takes its blocks
    taken = step(s)  # both rows write into the shared second block: the first gets a copy of it first
    assert len(taken.copies) == 1, taken.copies
    computed = [q.num_computed_tokens for q in taken.seqs]
    s.unschedule(taken)  # never submitted (its packing failed)
    assert [q.num_computed_tokens for q in taken.seqs] == [c - 1 for c in computed]
    again = step(s)
    assert again.copies == taken.copies, "the rows already write into their copies: the next step must make them"
    assert again.seqs == taken.seqs and again.starts == taken.starts


def test_a_recomputed_sequences_chunk_that_ends_at_its_prompt_samples_nothing() -> None:
    # Chunks of at most 4 tokens, 3 usable blocks: b is preempted after its first output, then
    # recomputes its prompt and that output in chunks. Its token comes only from the chunk that
    # reaches its last token, never from the one that ends where its prompt ends.
    s = Scheduler(SchedulerLimits(4, 4, 64, chunked_prefill=True), BlockManager(4, BLOCK), 4,
                  StopChecker(64, frozenset({1})))
    a, b = seq(0, prompt_len=3), seq(1, prompt_len=4)
    s.add(a)
    s.add(b)
    advance(s, 50)  # a's prompt and b's first token of prompt
    advance(s, 51)  # a decodes; the rest of b's prompt samples its first output
    assert b.output_token_ids == [51]
    advance(s, 52)  # a needs a second block: b, the latest, makes room
    assert b.status is Status.WAITING and b.block_table == [] and b.output_token_ids == [51]
    s.finish(a, FinishReason.abort)
    prompt_chunk = advance(s, 53)
    assert (prompt_chunk.seqs, prompt_chunk.starts, prompt_chunk.query_lens) == ([b], [0], [4])
    assert prompt_chunk.samples == [False], "a chunk short of the recomputed output samples nothing"
    assert b.num_pending == 0 and b.output_token_ids == [51]
    last = advance(s, 54)  # feeds its output again, and samples after it
    assert (last.starts, last.query_lens, last.samples) == ([4], [1], [True])
    assert b.output_token_ids == [51, 54]
