"""Packing: a scheduled step written into one arena (the step layout of :mod:`corelib.transport.wire`).

Runs on the scheduler side and needs no device. Per-sequence values that change rarely (block
tables, sampling settings, by state index) live in host tables updated only when they change, so
packing a decode step is a few vector ops; a step with prompt chunks adds each row's tokens.
"""

from __future__ import annotations

import itertools

import torch

from corelib.engine.scheduler import ScheduledStep
from corelib.engine.sequence import Sequence as EngineSequence
from corelib.ops.spec import SAMPLING_COLUMNS
from corelib.step.arena import RELAY
from corelib.step.forward_input import ForwardInput
from corelib.step.layout import EngineLayout
from corelib.transport.wire import pad_rows


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
            for column in SAMPLING_COLUMNS:
                self.state_sampling[column.name][index] = getattr(seq.sampling, column.param)
            self.state_prompt_lens[index] = seq.num_prompt_tokens
            written = 0
        if written < len(table):
            self.state_block_tables[index, written : len(table)] = torch.tensor(table[written:], dtype=torch.int32)
            written = len(table)
        self._owners[index] = (seq.seq_id, seq.blocks_epoch, written)

    def fill(self, step_id: int, step: ScheduledStep, arena: torch.Tensor, bucket: int, kv_blocks: int) -> ForwardInput:
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
            self._sync_state(seq, index)
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
