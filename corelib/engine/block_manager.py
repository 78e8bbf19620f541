"""Paged KV-cache bookkeeping: which blocks each sequence holds. Pure Python, no tensors.

Block 0 is never handed out: padded rows of a captured batch write their K/V there.
"""

from __future__ import annotations

from collections import deque

from corelib.engine.sequence import Sequence

NULL_BLOCK = 0


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Allocates KV blocks to sequences; a count per block catches a block released twice."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is the null block), got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_missing(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` still needs to hold ``num_tokens`` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Give a sequence without blocks enough for ``num_tokens`` tokens."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.request_id} already holds blocks")
        self.append(seq, num_tokens)

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_missing(seq, num_tokens) <= self.num_free_blocks

    def append(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq``'s block table to hold ``num_tokens`` tokens."""
        missing = self.num_missing(seq, num_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(
                f"sequence {seq.request_id} needs {missing} more KV blocks, {self.num_free_blocks} are free"
            )
        for _ in range(missing):
            block = self._free.popleft()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Drop every block of ``seq``: each returns to the pool."""
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.blocks_epoch += 1

    def _release(self, block: int) -> None:
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"KV block {block} released more often than allocated")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)
