"""Packing: a scheduled step written into one arena (the step layout of :mod:`corelib.step.fields`).

Runs on the scheduler side and needs no device. Per-sequence values that change rarely (block
tables, sampling settings, by state index) live in host tables updated only when they change, so
packing a decode step is a few vector ops; a step with prompt chunks adds each row's tokens
(:mod:`corelib.engine.token_fields`).

A request whose values the step's columns cannot hold (a temperature beyond float32, a seed
beyond int64) or whose packing fails for any other reason raises :class:`PackingError` naming
it, so the engine fails that request alone and runs the others.
"""

from __future__ import annotations

import ctypes
import math
import operator
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from corelib.engine.scheduler import ScheduledStep
from corelib.engine.sequence import Sequence as EngineSequence
from corelib.engine.step_masks import StepMasks
from corelib.engine.token_fields import TokenWriter
from corelib.ops.sampling import CUT_NEUTRAL, PENALTY_NEUTRAL
from corelib.ops.spec import SAMPLING_COLUMNS, SAMPLING_TABLES, SamplingColumn
from corelib.sampling_params import FLOAT32_MAX, INT64_LIMIT
from corelib.step.arena import ArenaLayout
from corelib.step.fields import PROMPT_LOGPROBS, TOKEN_MASK, TOKEN_NAMES, pad_row_fields
from corelib.step.forward_input import ForwardInput
from corelib.step.layout import EngineLayout
from corelib.support.faults import maybe_fail

INT64_RANGE = range(-INT64_LIMIT, INT64_LIMIT)


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_,
          torch.uint8: np.uint8}
# What a state index may hold other than the neutral value: a sampling column or table, or one of these flags.
SAMPLER, LOGPROBS, PENALIZED = "needs the sampler", "logprobs", "penalized"
_SPECIAL_NAMES = frozenset(
    {*(c.name for c in SAMPLING_COLUMNS), *(t.name for t in SAMPLING_TABLES), SAMPLER, LOGPROBS, PENALIZED}
)
_TABLE_NAMES = frozenset(t.name for t in SAMPLING_TABLES)
TEMPERATURE = "temperature"  # the column whose rows draw where above 0 (0, its neutral value: greedy)


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

    def __init__(self, layout: EngineLayout, defer_masks: bool = False, eager_only: bool = False) -> None:
        self.layout = layout
        # Structured output run ahead: a step's grammar masks are written after it is queued (fill_owed_masks).
        self.defer_masks = defer_masks
        # Every step runs eagerly (no graphs): a step carrying a mask samples through it in any variant.
        self.eager_only = eager_only
        self.max_rows = layout.rows
        self.max_blocks = layout.max_blocks
        self.block_size = layout.block_size
        self.pad_state_index = layout.pad_state_index
        self.decode = layout.decode_layout
        states = self.pad_state_index + 1
        # Host tables by state index, written through numpy: a small numpy op costs a fraction of a torch
        # one, and a decode step is a few dozen of them.
        self.state_block_tables = np.zeros((states, self.max_blocks), dtype=np.int32)
        # Sampling values by state index, one host table per column, refreshed when an index changes owner.
        self.state_sampling: dict[str, npt.NDArray[Any]] = {
            c.name: np.full((states,), c.neutral, dtype=_NUMPY[c.dtype]) for c in SAMPLING_COLUMNS}
        # The sampling tables by state index (logit_bias, min_tokens' stop ids), refreshed with the columns.
        self.state_tables: dict[str, npt.NDArray[Any]] = {
            t.name: np.full((states, t.width), t.neutral, dtype=_NUMPY[t.dtype]) for t in SAMPLING_TABLES}
        self.state_prompt_lens = np.ones(states, dtype=np.int64)
        self.state_sampler = np.zeros(states, dtype=np.bool_)  # the row needs more than greedy argmax
        self.state_logprobs = np.zeros(states, dtype=np.bool_)  # the row asks for logprobs
        self._owners: list[tuple[int, int, int]] = [(-1, -1, 0)] * states  # seq_id, blocks_epoch, blocks written
        self.state_penalized = np.zeros(states, dtype=np.bool_)  # the row has a penalty: the device counts its tokens
        # Whose tokens the device's penalty counts of each state index are (seq_id, blocks_epoch): set once a step that
        # rebuilds them is packed whole. A sequence new to its index (admitted, resumed after preemption, a sample
        # of ``n`` given its prompt's blocks) has a new pair; so has one given a copy of a shared block (rebuilt
        # once more: the same tokens).
        self._counted: list[tuple[int, int]] = [(-1, -1)] * states
        # Numpy views of each (layout, arena) packed so far; the layout is kept so that its id stays its own.
        self._views: dict[tuple[int, int, int], tuple[ArenaLayout, dict[str, npt.NDArray[Any]]]] = {}
        # Which state indices hold a value other than the neutral one, by column, table or flag (_SPECIAL_NAMES): a
        # column no index holds one of is written as its neutral value over the step's rows, padding included, not
        # gathered by index; a flag none holds needs no look at the step's rows. Exact: the bytes are compared.
        self._specials: list[frozenset[str]] = [frozenset()] * states
        self._special_counts: dict[str, int] = dict.fromkeys(_SPECIAL_NAMES, 0)
        self._neutral: dict[str, float] = {c.name: c.neutral for c in SAMPLING_COLUMNS}
        self._neutral.update((t.name, t.neutral) for t in SAMPLING_TABLES)
        self._neutral_bytes = {name: self.state_sampling[name][:1].tobytes() for name in self.state_sampling}
        self._neutral_bytes.update((name, table[0].tobytes()) for name, table in self.state_tables.items())
        self.tokens = TokenWriter(self.state_block_tables, self.block_size,
                                  max(layout.max_step_tokens, layout.max_model_len, layout.rows))

    def _numpy_views(self, layout: ArenaLayout, arena: torch.Tensor) -> dict[str, npt.NDArray[Any]]:
        """``layout``'s fields over host ``arena`` as numpy arrays (writes go to the arena), made once per arena.

        The views hold the arena's address, not the arena: they never keep it alive (whoever owns
        the step's inputs does), and they are used only for an arena found at that address with that
        size, whose bytes they then are.
        """
        key = (id(layout), arena.data_ptr(), arena.numel())
        cached = self._views.get(key)
        if cached is not None:
            return cached[1]
        if arena.dtype != torch.uint8 or arena.numel() < layout.nbytes or arena.device.type != "cpu" \
                or not arena.is_contiguous():
            raise ValueError(f"arena must be a contiguous host uint8 tensor of at least {layout.nbytes} bytes")
        if len(self._views) >= 512:  # arenas are a small pool; step layouts, one per token count in use
            self._views.clear()
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * arena.numel()).from_address(arena.data_ptr()))
        views: dict[str, npt.NDArray[Any]] = {
            f.name: raw[offset : offset + f.nbytes].view(_NUMPY[f.dtype]).reshape(f.shape)
            for f, offset in zip(layout.fields, layout.offsets, strict=True)}
        self._views[key] = (layout, views)
        return views

    def _sync_state(self, seq: EngineSequence, index: int) -> None:
        """Bring the cached block table and sampling values of state ``index`` up to date with ``seq``."""
        owner, epoch, written = self._owners[index]
        table = seq.block_table
        if owner != seq.seq_id or epoch != seq.blocks_epoch:
            held = self._specials[index]
            self._set_specials(index, _SPECIAL_NAMES)  # until its values are all written: gathered, whatever they are
            neutral_bytes, special = self._neutral_bytes, set()
            for column, value in zip(SAMPLING_COLUMNS, self.sampling_row(seq), strict=True):
                values = self.state_sampling[column.name]
                values[index] = value
                if values[index : index + 1].tobytes() != neutral_bytes[column.name]:
                    special.add(column.name)
            sampling = seq.sampling
            # Without logit_bias and min_tokens a request's table rows are neutral: written only over another's.
            if sampling.logit_bias or sampling.min_tokens or not held.isdisjoint(_TABLE_NAMES):
                for name, row in table_rows(seq).items():
                    self.state_tables[name][index] = row
                    if row.tobytes() != neutral_bytes[name]:
                        special.add(name)
            self.state_prompt_lens[index] = seq.num_prompt_tokens
            # A grammar's mask is applied by the sampled decode graphs: a structured row takes them even when greedy,
            # unless its mask is owed or no step replays a graph (the runner then masks any variant).
            self.state_sampler[index] = sampling.needs_sampler or (
                seq.grammar is not None and not self.defer_masks and not self.eager_only)
            self.state_logprobs[index] = sampling.logprobs is not None
            self.state_penalized[index] = any(
                self.state_sampling[name][index] != neutral for name, neutral in PENALTY_NEUTRAL.items())
            flags = {SAMPLER: self.state_sampler, LOGPROBS: self.state_logprobs, PENALIZED: self.state_penalized}
            special.update(name for name, flag in flags.items() if flag[index])
            self._set_specials(index, frozenset(special))
            written = 0
        if written < len(table):
            self.state_block_tables[index, written : len(table)] = table[written:]
            written = len(table)
        self._owners[index] = (seq.seq_id, seq.blocks_epoch, written)

    def _set_specials(self, index: int, names: frozenset[str]) -> None:
        counts = self._special_counts
        for name in self._specials[index]:
            counts[name] -= 1
        for name in names:
            counts[name] += 1
        self._specials[index] = names

    @staticmethod
    def sampling_row(seq: EngineSequence) -> list[float | int]:
        """``seq``'s values of the sampling columns, in column order; PackingError naming it when one does not fit."""
        try:
            maybe_fail("pack")
            return [column_value(c, getattr(seq.sampling, c.param)) for c in SAMPLING_COLUMNS]
        except Exception as error:  # whatever it is, it is this request's
            raise _failed(seq, error) from error

    def fill(self, step_id: int, step: ScheduledStep, arena: torch.Tensor, bucket: int, kv_blocks: int,
             padded: int = 0) -> ForwardInput:
        """The step in ``arena``; PackingError naming the requests at fault, the arena then holding nothing useful.

        ``padded``: a step with prompt tokens padded to that token bucket, over ``bucket`` rows (the layout's).
        """
        try:
            return self._fill(step_id, step, arena, bucket, kv_blocks, padded)
        except PackingError:
            raise
        except Exception as error:
            # No request alone is at fault: the step's requests fail, not the engine.
            message = f"a step of {len(step.seqs)} request(s) cannot be packed: {error}"
            raise PackingError(step.seqs, message) from error

    def _fill(
        self, step_id: int, step: ScheduledStep, arena: torch.Tensor, bucket: int, kv_blocks: int, padded: int
    ) -> ForwardInput:
        """Pack ``step`` into ``arena``: ``bucket`` rows computed (a decode step pads to its graph's), ``kv_blocks``
        block-table columns."""
        n = len(step.seqs)
        num_tokens, longest = step.num_tokens, max(step.query_lens)
        decode = longest == 1
        if padded:
            layout = self.layout.padded_layout(padded)
        else:
            layout = self.decode if decode else self.layout.step_layout(num_tokens)
        prompt_positions = sum(count for _, _, count in step.prompt_logprobs)
        if prompt_positions:
            layout = self.layout.with_prompt_logprobs(layout, prompt_positions)
        structured = [row for row, (seq, samples) in enumerate(zip(step.seqs, step.samples, strict=True))
                      if samples and seq.grammar is not None]
        if structured:
            layout = self.layout.masked(layout)
        v = self._numpy_views(layout, arena)
        if structured and not self.defer_masks:
            fill_masks(step, structured, v[TOKEN_MASK])
        if prompt_positions:
            fill_prompt_positions(step, v[PROMPT_LOGPROBS])
        pad = self.pad_state_index
        index_t = np.array(self._sync_rows(step.seqs), dtype=np.int64)
        seq_lens = np.array(step.seq_lens, dtype=np.int64)
        leading = 0 if decode else next(i for i, q in enumerate(step.query_lens) if q > 1)
        if decode:
            self.tokens.decode(step, v, index_t, seq_lens)
        else:
            self.tokens.with_prompts(step, v, index_t, seq_lens, leading)
        # Rows of the layout this step writes: its own, and those it is padded to (a graph's).
        filled = bucket if padded or (decode and bucket > n) else n
        counts = self._special_counts
        v["seq_lens"][:n] = seq_lens
        v["state_indices"][:n] = index_t
        # The relay slot of each row's sample: its state index, the padding one for a row that samples nothing.
        v["sample_slots"][:n] = index_t if all(step.samples) else np.where(step.samples, index_t, pad)
        v["prompt_lens"][:n] = self.state_prompt_lens[index_t]
        for tables in (self.state_sampling, self.state_tables):
            for name, table in tables.items():
                if counts[name]:
                    v[name][:n] = table[index_t]
                    if filled > n:
                        v[name][n:filled] = self._neutral[name]
                else:  # no row of any step holds a value of its own here
                    v[name][:filled] = self._neutral[name]
        v["block_tables"][:n, :kv_blocks] = self.state_block_tables[index_t, :kv_blocks]
        copies = len(step.copies)
        if copies:
            v["copy_from"][:copies] = [source for source, _ in step.copies]
            v["copy_to"][:copies] = [copy for _, copy in step.copies]
        recounts = self._recounts(step.seqs, index_t) if counts[PENALIZED] else []
        if recounts:
            v["recount_rows"][: len(recounts)] = recounts
        if filled > n:  # rows past the step's are empty (their sampling columns are written above)
            pad_row_fields(v, n, filled, kv_blocks, pad, sampling=False)
        if padded:  # and its tokens past num_tokens belong to none
            v["query_start"][n + 1 : bucket + 1] = num_tokens
            for name in TOKEN_NAMES:
                v[name][num_tokens:padded] = 0
        elif filled > n:  # a decode step padded to its graph's rows: one token each
            for name in TOKEN_NAMES:
                v[name][n:filled] = 0
        rows, tokens = (bucket, bucket) if decode else (n, num_tokens)
        if padded:
            rows, tokens = bucket, padded
        sample = bool(counts[SAMPLER]) and bool(self.state_sampler[index_t].any())
        # The draw (noise over the vocabulary) only where a row has a temperature: others take the processed argmax.
        draws = sample and bool(counts[TEMPERATURE]) and bool((self.state_sampling[TEMPERATURE][index_t] > 0).any())
        # ...and the sort of the vocabulary only where some row has a cut (for any row: greedy ones ignore theirs).
        cuts = draws and any(bool(counts[name]) and bool((self.state_sampling[name][index_t] != neutral).any())
                             for name, neutral in CUT_NEUTRAL.items())
        logprobs = bool(counts[LOGPROBS]) and bool(self.state_logprobs[index_t].any())
        fi = ForwardInput(step_id, n, rows, tokens, longest, kv_blocks, sample, layout, arena, logprobs, copies,
                          leading, bool(padded), prompt_positions, num_recounts=len(recounts),
                          mask_deferred=bool(structured) and self.defer_masks, draws=draws, cuts=cuts)
        for row in recounts:  # the step is packed whole: the device will have rebuilt these
            seq = step.seqs[row]
            self._counted[int(index_t[row])] = (seq.seq_id, seq.blocks_epoch)
        return fi

    def _sync_rows(self, seqs: list[EngineSequence]) -> list[int]:
        """Each row's state index, its cached values brought up to date first where they are not (a new owner, a
        table grown): most rows of most steps need nothing, and are only looked at."""
        pad, owners = self.pad_state_index, self._owners
        indices: list[int] = []
        for seq in seqs:
            index = seq.state_index
            if index is None:
                index = pad
            owner, epoch, written = owners[index]
            if owner != seq.seq_id or epoch != seq.blocks_epoch or written < len(seq.block_table):
                try:
                    self._sync_state(seq, index)
                except PackingError:
                    raise
                except Exception as error:  # this request's values or tables
                    raise _failed(seq, error) from error
            indices.append(index)
        return indices

    def fill_owed_masks(self, step: ScheduledStep, fi: ForwardInput) -> torch.Tensor:
        """The grammar masks of a step queued before them (``fi.mask_deferred``), written into its arena now that
        every earlier step's tokens were read: the rows [rows, words] int32 for the device to copy. A request
        finished since the step was queued gets a neutral row (its token is never read). PackingError names a
        request whose grammar failed; the caller ends it and asks again."""
        masks = self.owed_masks(step, fi)
        masks.compute()
        return masks.finish()

    def owed_masks(self, step: ScheduledStep, fi: ForwardInput) -> StepMasks:
        """:meth:`fill_owed_masks` in its parts, for the grammars' rows to be computed on another thread."""
        structured = [row for row, (seq, samples) in enumerate(zip(step.seqs, step.samples, strict=True))
                      if samples and seq.grammar is not None and not seq.is_finished]
        return StepMasks(step, structured, self._numpy_views(fi.layout, fi.arena)[TOKEN_MASK],
                         fi.layout.view(fi.arena, TOKEN_MASK), _failed)

    def _recounts(self, seqs: list[EngineSequence], index_t: npt.NDArray[np.int64]) -> list[int]:
        """The rows whose penalty counts the device rebuilds before the step's forward: those with a penalty whose
        state index does not count their tokens yet. Rows without one cost a vector op."""
        penalized = np.flatnonzero(self.state_penalized[index_t])
        return [int(row) for row in penalized
                if self._counted[int(index_t[row])] != (seqs[row].seq_id, seqs[row].blocks_epoch)]


def table_rows(seq: EngineSequence) -> dict[str, npt.NDArray[Any]]:
    """``seq``'s rows of the sampling tables: its logit_bias as (id, bias) pairs, and the stop ids min_tokens bans
    (its stop ids and, unless ignore_eos, EOS: those that would end it); ValueError when they do not fit."""
    rows: dict[str, npt.NDArray[Any]] = {
        t.name: np.full((t.width,), t.neutral, dtype=_NUMPY[t.dtype]) for t in SAMPLING_TABLES}
    bias = seq.sampling.logit_bias or {}
    rows["bias_ids"][: len(bias)] = list(bias)
    rows["bias_values"][: len(bias)] = list(bias.values())
    if seq.sampling.min_tokens:
        stops = sorted(seq.ends.stop_ids if seq.ends is not None else seq.sampling.stop_token_ids)
        width = len(rows["stop_ids"])
        if len(stops) > width:
            raise ValueError(f"min_tokens bans {len(stops)} stop ids (stop_token_ids and EOS): at most {width}")
        rows["stop_ids"][: len(stops)] = stops
    return rows


def fill_prompt_positions(step: ScheduledStep, out: npt.NDArray[Any]) -> None:
    """``out`` [2, P]: each of ``step.prompt_logprobs``' positions, in order, as its index among the step's tokens
    (row 0) and the prompt token after it (row 1)."""
    offsets = np.concatenate([[0], np.cumsum(step.query_lens)])
    at = 0
    for row, first, count in step.prompt_logprobs:
        seq = step.seqs[row]
        start = int(offsets[row]) + first - step.starts[row]
        out[0, at : at + count] = np.arange(start, start + count)
        out[1, at : at + count] = seq.prompt_token_ids[first + 1 : first + 1 + count]
        at += count


def fill_masks(step: ScheduledStep, rows: list[int], masks: npt.NDArray[Any]) -> None:
    """Each structured row's token bitmask from its grammar, the rows in parallel; every other row allows every
    token. A failure is told to the request whose grammar failed (found by filling the rows one by one)."""
    job = StepMasks(step, rows, masks, torch.from_numpy(masks), _failed)
    job.compute()
    job.finish()
