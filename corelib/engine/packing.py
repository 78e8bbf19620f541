"""Packing: a scheduled step written into one arena (the step layout of :mod:`corelib.transport.wire`).

Runs on the scheduler side and needs no device. Per-sequence values that change rarely (block
tables, sampling settings, by state index) live in host tables updated only when they change, so
packing a decode step is a few vector ops; a step with prompt chunks adds each row's tokens.

A request whose values the step's columns cannot hold (a temperature beyond float32, a seed
beyond int64) or whose packing fails for any other reason raises :class:`PackingError` naming
it, so the engine fails that request alone and runs the others.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable

import torch

from corelib.engine.scheduler import ScheduledStep
from corelib.engine.sequence import Sequence as EngineSequence
from corelib.faults import maybe_fail
from corelib.ops.spec import SAMPLING_COLUMNS, SamplingColumn
from corelib.sampling_params import FLOAT32_MAX, INT64_LIMIT
from corelib.step.arena import RELAY
from corelib.step.forward_input import ForwardInput
from corelib.step.layout import EngineLayout
from corelib.transport.wire import pad_rows

INT64_RANGE = range(-INT64_LIMIT, INT64_LIMIT)


class PackingError(Exception):
    """Packing a step failed; ``seqs`` are the requests at fault (every request of the step when none alone is)."""

    def __init__(self, seqs: Iterable[EngineSequence], message: str) -> None:
        super().__init__(message)
        self.seqs = list(seqs)


def column_value(column: SamplingColumn, value: object) -> float | int:
    """``value`` as the column's dtype holds it; ValueError when it cannot hold it (numpy scalars are fine)."""
    if column.dtype.is_floating_point:
        number = float(value)  # type: ignore[arg-type]
        if not math.isfinite(number) or abs(number) > FLOAT32_MAX:
            raise ValueError(f"sampling.{column.param}={value!r} does not fit the device's float32 column")
        return number
    integer = operator.index(value)  # type: ignore[arg-type]
    if integer not in INT64_RANGE:
        raise ValueError(f"sampling.{column.param}={value!r} does not fit the device's int64 column")
    return integer


def _failed(seq: EngineSequence, error: Exception) -> PackingError:
    return PackingError([seq], f"request {seq.request_id!r} cannot be packed into a step: {error}")


class InputBuilder:
    """Packs a ScheduledStep into an arena. Runs on the scheduler side: no device needed.

    Per-sequence values that change rarely (block tables, sampling settings) live in host
    tables by state index, updated only when they change, so packing a decode step is a few vector ops.
    """

    def __init__(self, layout: EngineLayout) -> None:
        self.layout = layout
        self.max_rows = layout.rows
        self.max_blocks = layout.max_blocks
        self.block_size = layout.block_size
        self.pad_state_index = layout.pad_state_index
        self.decode = layout.decode_layout
        states = self.pad_state_index + 1
        self.state_block_tables = torch.zeros((states, self.max_blocks), dtype=torch.int32)
        # Sampling values by state index, one host table per column, refreshed when an index changes owner.
        self.state_sampling = {c.name: torch.full((states,), c.neutral, dtype=c.dtype) for c in SAMPLING_COLUMNS}
        self.state_prompt_lens = torch.ones(states, dtype=torch.int64)
        self._owners: list[tuple[int, int, int]] = [(-1, -1, 0)] * states  # seq_id, blocks_epoch, blocks written

    def _sync_state(self, seq: EngineSequence, index: int) -> None:
        """Bring the cached block table and sampling values of state ``index`` up to date with ``seq``."""
        owner, epoch, written = self._owners[index]
        table = seq.block_table
        if owner != seq.seq_id or epoch != seq.blocks_epoch:
            for column, value in zip(SAMPLING_COLUMNS, self.sampling_row(seq), strict=True):
                self.state_sampling[column.name][index] = value
            self.state_prompt_lens[index] = seq.num_prompt_tokens
            written = 0
        if written < len(table):
            self.state_block_tables[index, written : len(table)] = torch.tensor(table[written:], dtype=torch.int32)
            written = len(table)
        self._owners[index] = (seq.seq_id, seq.blocks_epoch, written)

    @staticmethod
    def sampling_row(seq: EngineSequence) -> list[float | int]:
        """``seq``'s values of the sampling columns, in column order; PackingError naming it when one does not fit."""
        try:
            maybe_fail("pack")
            return [column_value(c, getattr(seq.sampling, c.param)) for c in SAMPLING_COLUMNS]
        except Exception as error:  # whatever it is, it is this request's
            raise _failed(seq, error) from error

    def fill(self, step_id: int, step: ScheduledStep, arena: torch.Tensor, bucket: int, kv_blocks: int) -> ForwardInput:
        """The step in ``arena``; PackingError naming the requests at fault, the arena then holding nothing useful."""
        try:
            return self._fill(step_id, step, arena, bucket, kv_blocks)
        except PackingError:
            raise
        except Exception as error:
            # No request alone is at fault: the step's requests fail, not the engine.
            message = f"a step of {len(step.seqs)} request(s) cannot be packed: {error}"
            raise PackingError(step.seqs, message) from error

    def _fill(
        self, step_id: int, step: ScheduledStep, arena: torch.Tensor, bucket: int, kv_blocks: int
    ) -> ForwardInput:
        """Pack ``step`` into ``arena``: ``bucket`` rows computed (a decode step pads to its graph's), ``kv_blocks``
        block-table columns."""
        n = len(step.seqs)
        num_tokens, longest = step.num_tokens, max(step.query_lens)
        decode = longest == 1
        layout = self.decode if decode else self.layout.step_layout(num_tokens)
        v = layout.views(arena)
        pad = self.pad_state_index
        indices: list[int] = []
        for seq in step.seqs:
            index = seq.state_index if seq.state_index is not None else pad
            try:
                self._sync_state(seq, index)
            except PackingError:
                raise
            except Exception as error:  # this request's values or tables
                raise _failed(seq, error) from error
            indices.append(index)
        index_t = torch.tensor(indices, dtype=torch.int64)
        seq_lens = torch.tensor(step.seq_lens, dtype=torch.int64)
        if decode:
            ids = [RELAY if relay else seq.token_at(p)
                   for seq, p, relay in zip(step.seqs, step.starts, step.from_relay, strict=True)]
            positions = seq_lens - 1
            token_states = index_t
        else:
            ids = list(itertools.chain.from_iterable(
                _row_tokens(seq, start, q, relay)
                for seq, start, q, relay in zip(step.seqs, step.starts, step.query_lens, step.from_relay, strict=True)))
            lengths = torch.tensor(step.query_lens, dtype=torch.int64)
            token_states = index_t.repeat_interleave(lengths)
            # Each token's position: its row's start plus its place in the row.
            row_first = torch.cumsum(lengths, 0) - lengths
            positions = torch.arange(num_tokens) - row_first.repeat_interleave(lengths) + \
                torch.tensor(step.starts, dtype=torch.int64).repeat_interleave(lengths)
            v["query_start"][0] = 0
            v["query_start"][1 : n + 1] = torch.cumsum(lengths, 0)
        v["input_ids"][:num_tokens] = torch.tensor(ids, dtype=torch.int64)
        v["positions"][:num_tokens] = positions
        block = self.state_block_tables[token_states, positions // self.block_size].to(torch.int64)
        v["slot_mapping"][:num_tokens] = block * self.block_size + positions % self.block_size
        v["seq_lens"][:n] = seq_lens
        v["state_indices"][:n] = index_t
        v["sample_slots"][:n] = torch.where(torch.tensor(step.samples), index_t, pad)
        v["prompt_lens"][:n] = self.state_prompt_lens[index_t]
        for name, table in self.state_sampling.items():
            v[name][:n] = table[index_t]
        v["block_tables"][:n, :kv_blocks] = self.state_block_tables[index_t, :kv_blocks]
        copies = len(step.copies)
        if copies:
            v["copy_from"][:copies] = torch.tensor([source for source, _ in step.copies], dtype=torch.int64)
            v["copy_to"][:copies] = torch.tensor([copy for _, copy in step.copies], dtype=torch.int64)
        if decode and bucket > n:
            pad_rows(v, n, bucket, kv_blocks, pad)
        rows, tokens = (bucket, bucket) if decode else (n, num_tokens)
        sample = any(s.sampling.needs_sampler for s in step.seqs)
        logprobs = any(s.sampling.logprobs is not None for s in step.seqs)
        leading = 0 if decode else next(i for i, q in enumerate(step.query_lens) if q > 1)
        return ForwardInput(step_id, n, rows, tokens, longest, kv_blocks, sample, layout, arena, logprobs, copies,
                            leading)


def _row_tokens(seq: EngineSequence, start: int, count: int, relay: bool) -> list[int]:
    """The input ids of a row's ``count`` tokens from position ``start`` (its last from the relay when ``relay``)."""
    known = seq.num_tokens
    prompt = seq.prompt_token_ids
    end = start + count
    ids = prompt[start:min(end, len(prompt))]
    if end > len(prompt):
        ids = ids + seq.output_token_ids[max(start - len(prompt), 0) : min(end, known) - len(prompt)]
    if relay:
        ids = [*ids[: count - 1], RELAY]
    return ids
