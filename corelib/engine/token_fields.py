"""A step's token fields written into its arena: each token's input id, position and KV slot, and where each row's
tokens start (``query_start``), for the packer (:mod:`corelib.engine.packing`).

A decode step's tokens are one a row, written as vectors over its rows. A step with prompt tokens has its decode
rows first, written the same way; after them, a few rows of several tokens (prompt chunks) are written one by one,
each a handful of slice writes: the chunk's ids copied from the prompt's int64 buffer, its positions, KV blocks and
places in them slices of vectors made once. Many such rows (a burst of short prompts) are written as vectors over
the step's tokens instead: per row, slices would cost more than the vectors' fixed cost.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from corelib.engine.scheduler import ScheduledStep
from corelib.engine.sequence import Sequence as EngineSequence
from corelib.step.arena import RELAY

FEW_ROWS = 4  # a step's rows of several tokens written one by one (each a few slice writes); more, as vectors
Views = dict[str, npt.NDArray[Any]]


class TokenWriter:
    """Writes the token fields of a step from the packer's block tables by state index (kept up to date there)."""

    def __init__(self, block_tables: npt.NDArray[np.int32], block_size: int, longest: int) -> None:
        self.block_tables = block_tables
        self.block_size = block_size
        # 0, 1, 2, ... up to ``longest`` (a sequence's length, the most rows): a run of positions, or the rows' first
        # tokens, is a slice of it (a view), and so are the KV block and the place in it of each of a run of positions.
        self._counting = np.arange(longest + 1, dtype=np.int64)
        self._block_of = self._counting // block_size
        self._place_in_block = self._counting % block_size

    def decode(
        self, step: ScheduledStep, v: Views, index_t: npt.NDArray[np.int64], seq_lens: npt.NDArray[np.int64]
    ) -> None:
        """A decode step: token i is row i's, the one it sampled last (from the relay where still on the device)."""
        self._one_token_rows(step, v, index_t, seq_lens, len(step.seqs))

    def with_prompts(
        self,
        step: ScheduledStep,
        v: Views,
        index_t: npt.NDArray[np.int64],
        seq_lens: npt.NDArray[np.int64],
        leading: int,
    ) -> None:
        """A step with prompt tokens whose first ``leading`` rows feed one token each (its decode rows)."""
        if len(step.seqs) - leading <= FEW_ROWS:
            self._rows(step, v, index_t, seq_lens, leading)
        else:
            self._vectors(step, v, index_t)

    def _one_token_rows(
        self, step: ScheduledStep, v: Views, index_t: npt.NDArray[np.int64], seq_lens: npt.NDArray[np.int64], n: int
    ) -> None:
        """The first ``n`` rows, one token each (the last one sampled), as tokens ``[0, n)``: ids, positions, slots."""
        seqs, starts, relays = step.seqs, step.starts, step.from_relay
        if n < len(seqs):  # a decode step's rows are all of them: no copies of its lists
            seqs, starts, relays = seqs[:n], starts[:n], relays[:n]
        v["input_ids"][:n] = [
            RELAY if relay else seq.token_at(p) for seq, p, relay in zip(seqs, starts, relays, strict=True)
        ]
        self._slots(v, 0, n, index_t[:n], np.subtract(seq_lens[:n], 1, out=v["positions"][:n]))

    def _slots(
        self, v: Views, first: int, last: int, states: npt.NDArray[np.int64], positions: npt.NDArray[np.int64]
    ) -> None:
        """The KV slots of tokens ``[first, last)``, one a row, of the given state indices and positions."""
        size = self.block_size
        slots = v["slot_mapping"][first:last]
        np.multiply(self.block_tables[states, positions // size], size, out=slots, dtype=np.int64)
        slots += positions % size

    def _rows(
        self,
        step: ScheduledStep,
        v: Views,
        index_t: npt.NDArray[np.int64],
        seq_lens: npt.NDArray[np.int64],
        leading: int,
    ) -> None:
        """The ``leading`` rows of one token as a decode step's, then each of the few others with slice writes."""
        ids, positions, slots, query_start = v["input_ids"], v["positions"], v["slot_mapping"], v["query_start"]
        seqs, starts, lens, relays = step.seqs, step.starts, step.query_lens, step.from_relay
        if leading:
            self._one_token_rows(step, v, index_t, seq_lens, leading)
        counting, block_of, place_in_block = self._counting, self._block_of, self._place_in_block
        query_start[: leading + 1] = counting[: leading + 1]
        size, tables = self.block_size, self.block_tables
        at = leading
        for row in range(leading, len(seqs)):
            seq, start, count, relay = seqs[row], starts[row], lens[row], relays[row]
            end, stop = at + count, start + count
            write_row_ids(ids[at:end], seq, start, count, relay)
            positions[at:end] = counting[start:stop]
            row_slots = slots[at:end]
            np.multiply(tables[index_t[row]][block_of[start:stop]], size, out=row_slots, dtype=np.int64)
            row_slots += place_in_block[start:stop]
            at = end
            query_start[row + 1] = at

    def _vectors(self, step: ScheduledStep, v: Views, index_t: npt.NDArray[np.int64]) -> None:
        """Every row's tokens as vectors over the step's tokens."""
        n, num_tokens = len(step.seqs), step.num_tokens
        write_input_ids(step, v["input_ids"])
        lengths = np.array(step.query_lens, dtype=np.int64)
        ends = np.cumsum(lengths)
        # Each token's position: its row's start plus its place in the row.
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(
            np.array(step.starts, dtype=np.int64) - (ends - lengths), lengths
        )
        v["query_start"][0] = 0
        v["query_start"][1 : n + 1] = ends
        v["positions"][:num_tokens] = positions
        self._slots(v, 0, num_tokens, np.repeat(index_t, lengths), positions)


def write_input_ids(step: ScheduledStep, out: npt.NDArray[np.int64]) -> None:
    """The input ids of a step with prompt tokens into ``out``, its rows' one after another: a chunk of a prompt
    copied from the prompt's int64 buffer, a row of one token (a decode row) gathered with the others' in one
    write (RELAY where its token is still on the device), any other row token by token."""
    singles: list[int] = []  # where each row of one token has it
    single_ids: list[int] = []
    at = 0
    for seq, start, count, relay in zip(step.seqs, step.starts, step.query_lens, step.from_relay, strict=True):
        if count == 1:
            singles.append(at)
            single_ids.append(RELAY if relay else seq.token_at(start))
        else:
            write_row_ids(out[at : at + count], seq, start, count, relay)
        at += count
    out[singles] = single_ids


def write_row_ids(out: npt.NDArray[np.int64], seq: EngineSequence, start: int, count: int, relay: bool) -> None:
    """A row's ``count`` input ids from position ``start`` into ``out`` (its last from the relay when ``relay``)."""
    if start >= 0 and start + count <= seq.num_prompt_tokens:  # a chunk of its prompt: from the prompt's buffer
        prompt = seq.prompt_ids()
        out[:] = np.frombuffer(prompt, np.int64, count, start * prompt.itemsize)
        if relay:
            out[count - 1] = RELAY
    else:
        out[:] = row_tokens(seq, start, count, relay)


def row_tokens(seq: EngineSequence, start: int, count: int, relay: bool) -> list[int]:
    """The input ids of a row's ``count`` tokens from position ``start`` (its last from the relay when ``relay``)."""
    known = seq.num_tokens
    prompt = seq.prompt_token_ids
    end = start + count
    ids = prompt[start : min(end, len(prompt))]
    if end > len(prompt):
        ids = ids + seq.output_token_ids[max(start - len(prompt), 0) : min(end, known) - len(prompt)]
    if relay:
        ids = [*ids[: count - 1], RELAY]
    return ids
