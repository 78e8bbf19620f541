"""The prefix cache's bookkeeping, pure Python: chained keys (over the model's identity, and across
calls), reference counts, LRU eviction of free blocks only, a prompt found whole still computing its
last token, and keys only for blocks whose tokens the host knows and whose step was not taken back."""

from __future__ import annotations

import dataclasses

from corelib.config.schema import CorelibConfig
from corelib.engine.block_manager import BlockManager
from corelib.engine.scheduler import ScheduledStep, Scheduler, SchedulerLimits
from corelib.engine.sequence import FinishReason, SamplingParams, Sequence
from corelib.engine.stops import StopChecker
from corelib.testing.executor import scripted_core, unit_config, unit_options

BS = 4


def seq(i: int, prompt: list[int]) -> Sequence:
    return Sequence(i, f"r{i}", list(prompt), SamplingParams(max_tokens=4, ignore_eos=True))


def cached(bm: BlockManager, owner: Sequence) -> None:
    """``owner`` computed its prompt: its full blocks are keyed in the cache."""
    bm.allocate(owner, owner.num_tokens)
    bm.register(owner, owner.num_tokens)


def test_a_block_is_found_only_after_the_same_tokens_behind_the_same_prefix() -> None:
    bm = BlockManager(32, BS, prefix_caching=True)
    owner = seq(0, list(range(10, 23)))  # 13 tokens: 3 full blocks and a part
    cached(bm, owner)
    assert bm.num_cached_blocks == 3, "only full blocks are keyed"
    same = seq(1, [*range(10, 23), 99])
    assert bm.cached_prefix_tokens(same) == 3 * BS
    shifted = seq(2, [9, *range(10, 23)])  # the same blocks of tokens, one position later: another chain
    assert bm.cached_prefix_tokens(shifted) == 0
    middle = seq(3, [*range(10, 14), 77, 78, 79, 80, *range(18, 23)])  # its second block differs: the third misses
    assert bm.cached_prefix_tokens(middle) == BS
    moved = seq(4, [14, 15, 16, 17, 14, 15, 16, 17, 5])  # owner's second block, at the start: other positions
    assert bm.cached_prefix_tokens(moved) == 0, "a block's key depends on every block before it"


def test_another_model_finds_nothing() -> None:
    first, other = BlockManager(32, BS, True, "model a"), BlockManager(32, BS, True, "model b")
    owner = seq(0, list(range(10, 23)))
    cached(first, owner)
    probe = seq(1, list(range(10, 23)))
    assert first.cached_prefix_tokens(probe) == 12
    probe.block_keys.clear()
    cached(other, seq(2, [5, 6, 7, 8, 9]))
    assert other.cached_prefix_tokens(probe) == 0, "keys chain over the model's identity"


def test_engines_of_two_models_key_the_same_prompt_apart() -> None:
    def keys(config: CorelibConfig) -> list[bytes]:
        core, _ = scripted_core(config, dataclasses.replace(unit_options(), prefix_caching=True))
        owner = seq(0, list(range(10, 23)))
        cached(core.scheduler.blocks, owner)
        return owner.block_keys

    config = unit_config()
    reseeded = dataclasses.replace(config, model=dataclasses.replace(config.model, seed=config.model.seed + 1))
    assert keys(config) == keys(unit_config()), "the same model keys the same tokens alike"
    assert not set(keys(config)) & set(keys(reseeded)), "other weights: other keys"


def test_a_shared_block_is_counted_once_per_holder_and_freed_by_the_last() -> None:
    bm = BlockManager(16, BS, prefix_caching=True)
    owner = seq(0, list(range(10, 23)))
    cached(bm, owner)
    reader = seq(1, list(range(10, 23)))
    assert bm.allocate_prefix(reader) == 12 and reader.block_table == owner.block_table[:3]
    assert [bm.ref_counts[b] for b in reader.block_table] == [2, 2, 2]
    bm.free(owner)
    assert [bm.ref_counts[b] for b in reader.block_table] == [1, 1, 1]
    bm.free(reader)
    assert bm.num_free_blocks == 15 and bm.num_cached_blocks == 3, "free blocks stay cached"


def test_only_free_blocks_are_evicted_and_the_least_recently_freed_go_first() -> None:
    bm = BlockManager(9, BS, prefix_caching=True)  # 8 usable blocks
    old, hot = seq(0, list(range(10, 19))), seq(1, list(range(50, 59)))  # 2 full blocks each
    cached(bm, old)
    cached(bm, hot)
    bm.free(old)  # old's blocks are freed first: the least recent
    holder = seq(2, list(range(50, 59)))
    assert bm.allocate_prefix(holder) == 8  # hot's blocks, held again
    bm.free(hot)
    filler = seq(3, [1] * (2 * BS))
    bm.allocate(filler, 2 * BS)  # two uncached blocks are free first; then the least recent cached ones
    bm.allocate(seq(4, [2] * (4 * BS)), 4 * BS)
    assert bm.stats.evicted_blocks == 2
    assert bm.cached_prefix_tokens(seq(5, list(range(10, 19)))) == 0, "old's prefix was evicted first"
    assert bm.cached_prefix_tokens(seq(6, list(range(50, 59)))) == 8, "a block someone holds is never evicted"


def test_the_prefix_freed_longest_ago_is_evicted_before_a_later_one() -> None:
    bm = BlockManager(7, BS, prefix_caching=True)  # 6 usable blocks
    first, later = seq(0, list(range(10, 18))), seq(1, list(range(50, 58)))  # 2 full blocks each, nothing more
    cached(bm, first)
    cached(bm, later)
    bm.allocate(seq(2, [1] * (2 * BS)), 2 * BS)  # the other two blocks: nothing free is uncached
    bm.free(first)
    bm.free(later)
    bm.allocate(seq(3, [3]), 1)  # one block: the least recently freed, first's last block
    assert bm.cached_prefix_tokens(seq(4, [*range(10, 18), 0])) == BS, "first keeps only its first block"
    assert bm.cached_prefix_tokens(seq(5, [*range(50, 58), 0])) == 2 * BS, "the later prefix is intact"


def test_a_prompt_found_whole_still_computes_its_last_token() -> None:
    s = Scheduler(SchedulerLimits(4, 64, 64), BlockManager(32, BS, prefix_caching=True), 4,
                  StopChecker(64, frozenset()))
    prompt = list(range(10, 10 + 3 * BS))  # exactly 3 full blocks
    first = seq(0, prompt)
    s.add(first)
    step = s.schedule(in_flight=False, sync_check=lambda seqs: [])
    assert isinstance(step, ScheduledStep)
    s.postprocess(step, [7])
    again = seq(1, prompt)
    s.add(again)
    step = s.schedule(in_flight=False, sync_check=lambda seqs: [])
    assert isinstance(step, ScheduledStep) and step.seqs == [again]
    assert step.starts == [2 * BS] and step.query_lens == [BS], "the last block is computed, not shared"
    assert step.samples == [True]
    assert s.blocks.stats.hit_tokens == 2 * BS and s.blocks.stats.queried_tokens == 2 * len(prompt)


def scheduler() -> Scheduler:
    return Scheduler(SchedulerLimits(4, 64, 64), BlockManager(32, BS, prefix_caching=True), 4,
                     StopChecker(64, frozenset()))


def scheduled(s: Scheduler, in_flight: bool = False) -> ScheduledStep:
    step = s.schedule(in_flight=in_flight, sync_check=lambda seqs: [])
    assert isinstance(step, ScheduledStep), step
    return step


def test_keys_added_in_a_later_call_chain_on_the_blocks_keyed_before() -> None:
    bm = BlockManager(32, BS, prefix_caching=True)
    owner = seq(0, list(range(10, 15)))  # 5 tokens: its first block is keyed now
    cached(bm, owner)
    assert len(owner.block_keys) == 1
    owner.output_token_ids += [20, 21, 22, 23]  # its second block fills as it decodes, and is keyed later
    bm.append(owner, owner.num_tokens)
    bm.register(owner, owner.num_tokens)
    assert len(owner.block_keys) == 2 and bm.num_cached_blocks == 2
    probe = seq(1, [*range(10, 15), 20, 21, 22, 23, 99])  # the same 8 tokens, keyed in one call
    assert bm.cached_prefix_tokens(probe) == 2 * BS, "the second block's key must chain over the first"
    assert probe.block_keys == owner.block_keys


def test_the_same_prompt_cached_by_two_models_is_keyed_apart() -> None:
    prompt = list(range(10, 23))  # 3 full blocks and a part
    first, other, again = (BlockManager(32, BS, True, name) for name in ("model a", "model b", "model a"))
    in_first, in_other, in_again = seq(0, prompt), seq(1, prompt), seq(2, prompt)
    cached(first, in_first)
    cached(other, in_other)
    cached(again, in_again)
    assert in_first.block_keys == in_again.block_keys, "one model keys the same tokens alike"
    assert not set(in_first.block_keys) & set(in_other.block_keys), "keys chain over the model's identity"
    probe = seq(3, prompt)
    assert first.cached_prefix_tokens(probe) == 3 * BS
    assert other.cached_prefix_tokens(probe) == 0, "keys made for one model find nothing in another"


def test_a_step_taken_back_forgets_the_key_of_the_block_it_completed() -> None:
    s = scheduler()
    a = seq(0, [10, 11, 12])
    s.add(a)
    s.postprocess(scheduled(s), [13])
    decode = scheduled(s)  # feeds position 3: the first block is full and keyed
    assert decode.starts == [3] and s.blocks.num_cached_blocks == 1
    s.unschedule(decode)  # never run: the block's last KV slot holds nothing yet
    assert s.blocks.num_cached_blocks == 0 and a.num_registered_blocks == 0
    assert s.blocks.cached_prefix_tokens(seq(1, [10, 11, 12, 13, 14])) == 0
    again = scheduled(s)
    assert again.starts == [3] and s.blocks.num_cached_blocks == 1, "the step made again keys the block again"
    assert s.blocks.cached_prefix_tokens(seq(2, [10, 11, 12, 13, 14])) == BS


def test_a_prompt_step_taken_back_forgets_the_keys_of_the_blocks_it_filled() -> None:
    s = scheduler()
    a = seq(0, list(range(10, 19)))  # 9 tokens: 2 full blocks
    s.add(a)
    prefill = scheduled(s)
    assert s.blocks.num_cached_blocks == 2
    s.unschedule(prefill)
    assert s.blocks.num_cached_blocks == 0 and a.num_registered_blocks == 0
    assert s.blocks.cached_prefix_tokens(seq(1, list(range(10, 19)))) == 0


def test_a_block_is_keyed_only_once_the_host_knows_its_tokens() -> None:
    s = scheduler()
    a = seq(0, [10, 11, 12])  # the first sampled token completes the first block
    s.add(a)
    prefill = scheduled(s)
    ahead = scheduled(s, in_flight=True)  # runs ahead: feeds that token from the device, unseen by the host
    assert ahead.starts == [3] and ahead.from_relay == [True] and a.num_computed_tokens == 4
    assert s.blocks.num_cached_blocks == 0 and a.num_registered_blocks == 0, "keyed over a token still pending"
    s.postprocess(prefill, [13])
    s.postprocess(ahead, [14])
    scheduled(s)  # the next step, with every token known, keys it
    assert s.blocks.num_cached_blocks == 1
    assert s.blocks.cached_prefix_tokens(seq(1, [10, 11, 12, 13, 99])) == BS
    assert s.blocks.cached_prefix_tokens(seq(2, [10, 11, 12, 99, 99])) == 0


def test_a_free_cached_block_found_by_a_hit_leaves_the_free_list() -> None:
    bm = BlockManager(6, BS, prefix_caching=True)  # 5 usable blocks
    owner = seq(0, list(range(10, 19)))  # 2 full blocks and a part
    cached(bm, owner)
    bm.free(owner)  # its blocks stay cached on the free list
    assert bm.num_free_blocks == 5 and bm.num_cached_blocks == 2
    reader = seq(1, list(range(10, 19)))
    assert bm.allocate_prefix(reader) == 2 * BS
    assert bm.num_free_blocks == 3, "a block a sequence holds again is not free"
    assert [bm.ref_counts[b] for b in reader.block_table] == [1, 1]
    other = seq(2, [1] * (3 * BS))
    bm.allocate(other, 3 * BS)  # every block still free
    assert not set(other.block_table) & set(reader.block_table), "a held block was handed out again"
    assert bm.num_free_blocks == 0 and bm.stats.evicted_blocks == 0
    assert bm.cached_prefix_tokens(seq(3, list(range(10, 19)))) == 2 * BS


def decoding(i: int, prompt: list[int]) -> Sequence:
    return Sequence(i, f"r{i}", list(prompt), SamplingParams(max_tokens=64, ignore_eos=True))


def test_rows_crossing_a_block_together_key_their_blocks_over_a_few_steps() -> None:
    # Rows decoding in step fill a block on the same step; keying all of them at once put a millisecond of host
    # work on that step at bs 128. At most 2 * rows / block_size rows key a block per step (here 8 of 16), every
    # row within block_size / 2 steps, and a row that finishes with its key put off keys it as it finishes.
    rows = 16
    s = Scheduler(SchedulerLimits(rows, 256, 64), BlockManager(128, BS, prefix_caching=True), rows,
                  StopChecker(64, frozenset()))
    seqs = [decoding(i, [100 + 3 * i, 101 + 3 * i, 102 + 3 * i]) for i in range(rows)]  # the 4th token fills a block
    for a in seqs:
        s.add(a)
    step = scheduled(s)
    keyed_per_step = []
    for n in range(2 * BS):
        before = sum(a.num_registered_blocks for a in seqs)
        s.postprocess(step, [7 + n] * rows)
        step = scheduled(s)
        keyed_per_step.append(sum(a.num_registered_blocks for a in seqs) - before)
        full = [min(a.num_computed_tokens, a.num_tokens) // BS for a in seqs]
        behind = [a for a, f in zip(seqs, full, strict=True) if a.num_registered_blocks < f]
        if n % BS == BS // 2:  # half a block's steps after the rows' blocks filled
            assert not behind, f"step {n}: {len(behind)} rows still to key"
    assert max(keyed_per_step) == 2 * rows // BS, keyed_per_step
    assert sum(keyed_per_step) == 2 * rows, "each row keyed its two full blocks"
    # A finished row keys the blocks it had put off.
    late = decoding(rows, [1, 2, 3])
    many = Scheduler(SchedulerLimits(rows + 1, 256, 64), BlockManager(128, BS, prefix_caching=True), rows + 1,
                     StopChecker(64, frozenset()))
    for a in [*(decoding(100 + i, [200 + 3 * i, 201 + 3 * i, 202 + 3 * i]) for i in range(rows)), late]:
        many.add(a)
    first = scheduled(many)
    many.postprocess(first, [5] * (rows + 1))
    scheduled(many)  # the rows' first blocks fill: the last row in line is beyond this step's keys
    assert late.num_registered_blocks == 0 and late.num_computed_tokens == 4
    many.finish(late, FinishReason.length)
    assert many.blocks.cached_prefix_tokens(seq(rows + 1, [1, 2, 3, 5, 9])) == BS
