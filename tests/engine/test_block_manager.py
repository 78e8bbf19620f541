"""The block manager is pure bookkeeping: allocate, append, free."""

from __future__ import annotations

import pytest

from corelib.engine.block_manager import NULL_BLOCK, BlockManager
from corelib.engine.sequence import SamplingParams, Sequence
from corelib.step.buckets import blocks_for


def seq(i: int) -> Sequence:
    return Sequence(i, str(i), [1, 2, 3], SamplingParams())


def test_blocks_for_rounds_up() -> None:
    assert [blocks_for(n, 4) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]


def test_allocate_append_free_round_trip() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    a = seq(0)
    bm.allocate(a, 9)
    assert len(a.block_table) == 3
    assert NULL_BLOCK not in a.block_table
    assert bm.num_free_blocks == 2
    bm.append(a, 12)  # still 3 blocks
    assert len(a.block_table) == 3
    bm.append(a, 13)
    assert len(a.block_table) == 4 and bm.num_free_blocks == 1
    assert not bm.can_append(a, 4 * 6)
    bm.free(a)
    assert bm.num_free_blocks == 5 and a.block_table == []


def test_append_beyond_pool_raises_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    a = seq(0)
    with pytest.raises(RuntimeError, match="needs 3 more KV blocks"):
        bm.append(a, 12)
    assert bm.num_free_blocks == 2 and a.block_table == []


def test_double_release_is_caught() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(0)
    bm.allocate(a, 4)
    block = a.block_table[0]
    bm.free(a)
    a.block_table = [block]
    with pytest.raises(RuntimeError, match="released more often"):
        bm.free(a)


def test_copy_on_write_gives_a_block_of_its_own_and_marks_the_table_new() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    owner, sharer = seq(0), seq(1)  # 3 tokens: one partial block
    bm.allocate(owner, 3)
    bm.share(owner, sharer, 3)
    [shared] = owner.block_table
    assert sharer.block_table == [shared] and bm.ref_counts[shared] == 2
    epoch = sharer.blocks_epoch
    source, copy = bm.copy_on_write(sharer, 3)
    assert (source, sharer.block_table, owner.block_table) == (shared, [copy], [shared])
    assert copy not in (shared, NULL_BLOCK) and bm.ref_counts[shared] == 1 and bm.ref_counts[copy] == 1
    assert sharer.blocks_epoch == epoch + 1, "a table cached by its epoch (the packer's) must start over"
    assert owner.blocks_epoch == 0, "the holder that keeps the block keeps its table"
