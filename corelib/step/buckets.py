"""Which captured graph serves a step: batch-size and KV-width buckets of decode steps, token
buckets of steps that carry prompt tokens.

A pure function of the config and the device's capabilities, so the scheduler side (which
packs the inputs) and the device side (which replays the graph) agree without talking.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


def blocks_for(num_tokens: int, block_size: int) -> int:
    """The KV blocks ``num_tokens`` tokens span: a row's KV width, in blocks of ``block_size``."""
    return -(-num_tokens // block_size)


def powers_of_two_upto(limit: int) -> list[int]:
    values = []
    value = 1
    while value < limit:
        values.append(value)
        value *= 2
    values.append(limit)
    return values


#: the token ladder of steps with prompt tokens: (up to, step) pairs; past the last, steps of its step
TOKEN_LADDER = ((256, 16), (512, 32), (1024, 64), (4096, 256))
TOKEN_LADDER_STEP = 512


def token_ladder(limit: int) -> list[int]:
    """16 to 256 by 16, by 32 to 512, by 64 to 1024, by 256 to 4096, then by 512: every size below ``limit``,
    and ``limit`` itself. The steps grow with the size, as SGLang's ladder does: past 256 tokens a step
    is padded by at most a quarter."""
    sizes: list[int] = []
    size = 0
    while True:
        size += next((step for top, step in TOKEN_LADDER if size < top), TOKEN_LADDER_STEP)
        if size >= limit:
            return [*sizes, limit]
        sizes.append(size)


@dataclass(frozen=True)
class BucketPolicy:
    """Graph shapes. Without captured-parameter update, one graph per (batch, KV width) pair of decode steps:
    every power-of-two width, or, where the attention reads only live blocks, the full width and the widths
    the config names (the attention splits the width it is given, so a narrower graph splits a short context
    into fewer programs); one per token bucket of steps with prompt tokens (at the full width: they run their
    padded rows)."""

    batch_buckets: tuple[int, ...]  # empty: graphs off, every decode step runs eagerly
    kv_buckets: tuple[int, ...]
    max_blocks: int
    param_update: bool  # graphs are captured at the full width and updated to each step's width
    live_blocks_only: bool = False  # attention reads each sequence's live blocks: one full-width graph serves
    token_buckets: tuple[int, ...] = ()  # empty: every step with prompt tokens runs eagerly

    @classmethod
    def build(cls, graphs: bool, batch_sizes: Sequence[int], max_rows: int, max_blocks: int,
              param_update: bool, live_blocks_only: bool = False, token_sizes: Sequence[int] = (),
              live_widths: Sequence[int] = ()) -> BucketPolicy:
        """``token_sizes``: the token buckets of steps with prompt tokens (empty: none, they run eagerly);
        ``live_widths``: the KV widths (blocks) of decode graphs beside the full one where the attention reads
        only live blocks (a width past the full one stands for it).

        A batch size past ``max_rows`` stands for ``max_rows``: with buckets of 32 and 64 and 40 rows at most,
        a decode step of 33-40 rows replays a graph of 40 rather than running eagerly (and meeting, while
        serving, a kernel compiled for its row count)."""
        if not graphs:
            return cls((), (), max_blocks, param_update, live_blocks_only)
        batches = tuple(sorted({min(b, max_rows) for b in batch_sizes if b > 0}))
        if param_update:
            kv: tuple[int, ...] = (max_blocks,)
        elif live_blocks_only:
            kv = tuple(sorted({min(w, max_blocks) for w in live_widths if w > 0} | {max_blocks}))
        else:
            kv = tuple(powers_of_two_upto(max_blocks))
        return cls(batches, kv, max_blocks, param_update, live_blocks_only, tuple(sorted(set(token_sizes))))

    def token_bucket(self, num_tokens: int) -> int | None:
        """The token bucket a step with prompt tokens is padded to; None: past the largest (it runs eagerly)."""
        buckets = self.token_buckets
        if not buckets or num_tokens > buckets[-1]:
            return None
        return buckets[bisect.bisect_left(buckets, num_tokens)]

    def decode_shape(self, num_seqs: int, kv_needed: int) -> tuple[int, int, bool]:
        """(rows, KV columns, use a graph) for a decode batch."""
        if not self.batch_buckets or num_seqs > self.batch_buckets[-1]:
            return num_seqs, kv_needed, False
        rows = self.batch_buckets[bisect.bisect_left(self.batch_buckets, num_seqs)]
        if self.param_update or self.live_blocks_only:
            return rows, kv_needed, True
        return rows, self._width(kv_needed), True

    def _width(self, kv_blocks: int) -> int:
        """The narrowest captured KV width that holds ``kv_blocks`` (the last is the full width)."""
        return self.kv_buckets[bisect.bisect_left(self.kv_buckets, kv_blocks)]

    def graph_kv(self, kv_blocks: int) -> int:
        """The KV width the serving graph was captured with: where the attention reads only live blocks, the
        narrowest captured width that holds ``kv_blocks`` (the step packs only the columns it needs)."""
        if self.param_update or (self.live_blocks_only and not self.kv_buckets):
            return self.max_blocks
        return self._width(kv_blocks) if self.live_blocks_only else kv_blocks

    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, KV width) to capture, largest first (they share one memory pool)."""
        return [(b, kv) for b in reversed(self.batch_buckets) for kv in reversed(self.kv_buckets)]
