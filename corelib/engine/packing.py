"""Packing: a scheduled step written into one arena (layouts in :mod:`corelib.step.arena`).

Runs on the scheduler side and needs no device. Per-sequence values that change rarely (block
tables, sampling settings, by state index) live in host tables updated only when they change, so packing a
decode step is a few vector ops.

A request whose values the step's columns cannot hold (a temperature beyond float32, a seed
beyond int64) or whose packing fails for any other reason raises :class:`PackingError` naming
it, so the engine fails that request alone and runs the others.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable

import torch

from corelib.engine.scheduler import ScheduledStep
from corelib.engine.sequence import Sequence as EngineSequence
from corelib.faults import maybe_fail
from corelib.ops.spec import SAMPLING_COLUMNS, SamplingColumn
from corelib.step.arena import RELAY, ArenaLayout, decode_layout, prefill_layout
from corelib.step.forward_input import ForwardInput, StepKind, pad_decode_rows

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
INT64_RANGE = range(-(2**63), 2**63)


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

    def __init__(self, max_rows: int, max_blocks: int, block_size: int, pad_state_index: int) -> None:
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.pad_state_index = pad_state_index
        self.decode = decode_layout(max_rows, max_blocks)
        states = pad_state_index + 1
        self.state_block_tables = torch.zeros((states, max_blocks), dtype=torch.int32)
        # Sampling values by state index, one host table per column, refreshed when an index changes owner.
        self.state_sampling = {c.name: torch.full((states,), c.neutral, dtype=c.dtype) for c in SAMPLING_COLUMNS}
        self._owners: list[tuple[int, int, int]] = [(-1, -1, 0)] * states  # seq_id, blocks_epoch, blocks written

    def prefill_layout(self, step: ScheduledStep) -> ArenaLayout:
        lengths = [seq.num_tokens for seq in step.seqs]
        return prefill_layout(sum(lengths), len(lengths), max(lengths))

    def _kv_slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _sync_state(self, seq: EngineSequence, index: int) -> None:
        """Bring the cached block table and sampling values of state ``index`` up to date with ``seq``."""
        owner, epoch, written = self._owners[index]
        table = seq.block_table
        if owner != seq.seq_id or epoch != seq.blocks_epoch:
            for column, value in zip(SAMPLING_COLUMNS, self.sampling_row(seq), strict=True):
                self.state_sampling[column.name][index] = value
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
            if step.kind is StepKind.decode:
                return self._fill_decode(step_id, step, arena, bucket, kv_blocks)
            return self._fill_prefill(step_id, step, arena)
        except PackingError:
            raise
        except Exception as error:
            # No request alone is at fault: the step's requests fail, not the engine.
            message = f"a step of {len(step.seqs)} request(s) cannot be packed: {error}"
            raise PackingError(step.seqs, message) from error

    def _fill_decode(
        self, step_id: int, step: ScheduledStep, arena: torch.Tensor, bucket: int, kv_blocks: int
    ) -> ForwardInput:
        n = len(step.seqs)
        v = self.decode.views(arena)
        indices: list[int] = []
        ids: list[int] = []
        for seq, position, relay in zip(step.seqs, step.positions, step.from_relay, strict=True):
            index = seq.state_index if seq.state_index is not None else self.pad_state_index
            try:
                self._sync_state(seq, index)
                ids.append(RELAY if relay else seq.token_at(position))
            except PackingError:
                raise
            except Exception as error:  # this request's values or tables
                raise _failed(seq, error) from error
            indices.append(index)
        index_t = torch.tensor(indices, dtype=torch.int64)
        positions = torch.tensor(step.positions, dtype=torch.int64)
        v["input_ids"][:n] = torch.tensor(ids, dtype=torch.int64)
        v["positions"][:n] = positions
        block = self.state_block_tables[index_t, positions // self.block_size].to(torch.int64)
        v["slot_mapping"][:n] = block * self.block_size + positions % self.block_size
        v["seq_lens"][:n] = positions + 1
        v["state_indices"][:n] = index_t
        for name, table in self.state_sampling.items():
            v[name][:n] = table[index_t]
        v["block_tables"][:n, :kv_blocks] = self.state_block_tables[index_t, :kv_blocks]
        if bucket > n:
            pad_decode_rows(v, n, bucket, kv_blocks, self.pad_state_index)
        sample = any(s.sampling.temperature > 0 for s in step.seqs)
        return ForwardInput(step_id, StepKind.decode, n, bucket, kv_blocks, sample, self.decode, arena)

    def _fill_prefill(self, step_id: int, step: ScheduledStep, arena: torch.Tensor) -> ForwardInput:
        layout = self.prefill_layout(step)
        v = layout.views(arena)
        tokens: list[int] = []
        kv_slots: list[int] = []
        lengths = []
        rows: list[list[float | int]] = []
        for seq in step.seqs:
            ids = seq.all_token_ids()
            try:
                kv_slots += [self._kv_slot(seq.block_table, p) for p in range(len(ids))]
            except Exception as error:  # this request's block table
                raise _failed(seq, error) from error
            rows.append(self.sampling_row(seq))
            tokens += ids
            lengths.append(len(ids))
        longest = max(lengths)
        v["token_ids"].copy_(torch.tensor(tokens, dtype=torch.int64))
        v["positions"].copy_(torch.cat([torch.arange(length) for length in lengths]))
        v["slot_mapping"].copy_(torch.tensor(kv_slots, dtype=torch.int64))
        length_t = torch.tensor(lengths, dtype=torch.int64)
        ends = torch.cumsum(length_t, 0)
        v["cu_seqlens"][0] = 0
        v["cu_seqlens"][1:] = ends
        starts = ends - length_t
        columns = torch.arange(longest)
        valid = columns[None, :] < length_t[:, None]
        v["valid"].copy_(valid)
        v["pad_index"].copy_(torch.where(valid, starts[:, None] + columns[None, :], 0))
        v["last_index"].copy_(ends - 1)
        pad = self.pad_state_index
        v["state_indices"].copy_(torch.tensor([pad if s.state_index is None else s.state_index for s in step.seqs]))
        for position, column in enumerate(SAMPLING_COLUMNS):
            v[column.name].copy_(torch.tensor([row[position] for row in rows], dtype=column.dtype))
        sample = any(s.sampling.temperature > 0 for s in step.seqs)
        return ForwardInput(step_id, StepKind.prefill, len(lengths), len(lengths), 0, sample, layout, arena)
