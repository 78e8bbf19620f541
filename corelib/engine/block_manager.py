"""Paged KV-cache bookkeeping: which blocks each sequence holds, and which full blocks are cached. Pure Python.

Block 0 is never handed out: padded rows of a captured batch write their K/V there.

With prefix caching, a full block whose tokens are all known is keyed by a hash chained over
those tokens, the blocks before it and the model's identity, so two prompts that begin alike
find the same blocks. Blocks are reference counted; a block no sequence holds stays cached on
the free list, least recently freed first, and loses its key only when it is handed out again
(evicted). Blocks are handed out least recently freed first, so a hot prefix stays longest.
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from corelib.engine.sequence import Sequence
from corelib.step.buckets import blocks_for

NULL_BLOCK = 0


@dataclass
class PrefixCacheStats:
    """What the prefix cache saved: prompt tokens looked up, found, and blocks evicted."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockManager:
    """Allocates KV blocks to sequences; a count per block catches a block released twice."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False,
                 model_identity: str = "") -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is the null block), got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self._root = hashlib.blake2b(model_identity.encode(), digest_size=16).digest()
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))  # least recent first
        self._key_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # a full block's key -> the block holding it
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached ones included: they are handed out when needed)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def num_missing(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` still needs to hold ``num_tokens`` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    # ------------------------------------------------------------------ prefix caching
    def _keys(self, seq: Sequence, count: int) -> list[bytes]:
        """The keys of ``seq``'s first ``count`` full blocks (each computed once, kept on the sequence)."""
        keys = seq.block_keys
        if len(keys) < count:
            size = self.block_size
            parent = keys[-1] if keys else self._root
            blake2b = hashlib.blake2b
            prompt_blocks = min(count, seq.num_prompt_tokens // size)
            if len(keys) < prompt_blocks:  # blocks of the prompt: their bytes straight from its int64 buffer
                prompt = seq.prompt_ids()
                data, width = memoryview(prompt).cast("B"), size * prompt.itemsize
                for i in range(len(keys), prompt_blocks):
                    parent = blake2b(parent + data[i * width : (i + 1) * width], digest_size=16).digest()
                    keys.append(parent)
            if len(keys) < count:  # blocks that reach the outputs
                ids = seq.all_token_ids()
                for i in range(len(keys), count):
                    parent = blake2b(parent + array.array("q", ids[i * size : (i + 1) * size]).tobytes(),
                                     digest_size=16).digest()
                    keys.append(parent)
        return keys[:count]

    def prepare(self, seq: Sequence) -> None:
        """On a request's arrival: its prompt's int64 buffer and, with prefix caching, the keys of the blocks its
        prefix is looked up by, so that the step that admits it hashes nothing."""
        seq.prompt_ids()
        if self.prefix_caching:
            self._keys(seq, self._matchable(seq))

    def _matchable(self, seq: Sequence) -> int:
        # A prompt found whole still computes its last token: at most (known - 1) tokens come from the cache.
        # A request asking for prompt logprobs takes none: a cached position has no logits.
        if seq.sampling.prompt_logprobs is not None:
            return 0
        return (seq.num_tokens - 1) // self.block_size

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq`` (without blocks) the cache holds now, in whole blocks from the start."""
        if not self.prefix_caching:
            return 0
        hits = 0
        for key in self._keys(seq, self._matchable(seq)):
            if key not in self._cached:
                break
            hits += 1
        return hits * self.block_size

    def allocate_prefix(self, seq: Sequence) -> int:
        """Give a sequence without blocks the cached blocks its tokens begin with; returns the tokens they hold."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.request_id} already holds blocks")
        if not self.prefix_caching:
            return 0
        for key in self._keys(seq, self._matchable(seq)):
            block = self._cached.get(key)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
        seq.num_registered_blocks = len(seq.block_table)
        return len(seq.block_table) * self.block_size

    def count_lookup(self, seq: Sequence, hit_tokens: int) -> None:
        """A sequence was admitted with ``hit_tokens`` of its tokens found in the cache."""
        if self.prefix_caching:
            self.stats.queried_tokens += seq.num_tokens
            self.stats.hit_tokens += hit_tokens

    def register(self, seq: Sequence, num_computed: int) -> None:
        """Key the full blocks of ``seq`` whose tokens are known and whose KV is computed (or scheduled)."""
        if not self.prefix_caching:
            return
        full = min(num_computed, seq.num_tokens) // self.block_size
        registered = seq.num_registered_blocks
        if full <= registered:
            return
        self._keys(seq, full)
        cached, key_of, table = self._cached, self._key_of, seq.block_table
        for block, key in zip(table[registered:full], seq.block_keys[registered:full], strict=True):
            if key not in cached and key_of[block] is None:
                cached[key] = block
                key_of[block] = key
        seq.num_registered_blocks = full

    def unregister(self, seq: Sequence, num_computed: int) -> None:
        """Forget the keys of ``seq``'s blocks past the full blocks of its first ``num_computed`` tokens: a step
        that was never run keyed them, and their KV was never computed."""
        if not self.prefix_caching:
            return
        full = num_computed // self.block_size
        for block in seq.block_table[full : seq.num_registered_blocks]:
            key = self._key_of[block]
            if key is not None and self._cached.get(key) == block:
                del self._cached[key]
                self._key_of[block] = None
        seq.num_registered_blocks = min(seq.num_registered_blocks, full)

    # ------------------------------------------------------------------ blocks
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
        pop, key_of, refs, table = self._free.popitem, self._key_of, self.ref_counts, seq.block_table
        for _ in range(missing):
            block, _ = pop(last=False)
            key = key_of[block]
            if key is not None:  # the least recently freed cached block: its prefix is evicted
                del self._cached[key]
                key_of[block] = None
                self.stats.evicted_blocks += 1
            refs[block] = 1
            table.append(block)

    def share(self, source: Sequence, target: Sequence, num_tokens: int) -> None:
        """Give ``target`` (without blocks) ``source``'s blocks that hold its first ``num_tokens`` tokens, counted
        once more each; a partial last block is copied by the first of them to write into it."""
        if target.block_table:
            raise ValueError(f"sequence {target.request_id} already holds blocks")
        for block in source.block_table[: blocks_for(num_tokens, self.block_size)]:
            self.ref_counts[block] += 1
            target.block_table.append(block)

    def writes_shared_block(self, seq: Sequence, position: int) -> bool:
        """Whether writing ``position`` of ``seq`` would write into a block another sequence holds too."""
        index = position // self.block_size
        return index < len(seq.block_table) and self.ref_counts[seq.block_table[index]] > 1

    def copy_on_write(self, seq: Sequence, position: int) -> tuple[int, int]:
        """Give ``seq`` a block of its own for the shared block holding ``position``; returns (source, copy):
        the step that writes there copies the block first."""
        index = position // self.block_size
        source = seq.block_table[index]
        holder = Sequence(-1, "copy-on-write", [], seq.sampling)
        self.append(holder, 1)
        copy = holder.block_table[0]
        seq.block_table[index] = copy
        seq.num_registered_blocks = min(seq.num_registered_blocks, index)
        seq.blocks_epoch += 1  # the cached copy of its table is stale from this block on
        self._release(source)
        return source, copy

    def free(self, seq: Sequence) -> None:
        """Drop every block of ``seq``: each returns to the pool (its last blocks first, so they go first)."""
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_registered_blocks = 0
        seq.blocks_epoch += 1

    def _release(self, block: int) -> None:
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"KV block {block} released more often than allocated")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free[block] = None
