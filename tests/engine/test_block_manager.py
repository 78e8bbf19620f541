"""The block manager is pure bookkeeping: allocate, append, free."""

from __future__ import annotations

import pytest

from corelib.engine.block_manager import NULL_BLOCK, BlockManager, blocks_for
from corelib.engine.sequence import SamplingParams, Sequence


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
