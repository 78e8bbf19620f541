"""Inputs of the op conformance cases: each case builds the same tensors from a seed on any device.

Tensors are drawn on the CPU from a seeded generator and then moved, so a case is the same on
every device; ``build(seed)`` with another seed keeps every shape (a captured graph's static
buffers take the new values) and, for decode, shuffles the context lengths among the rows.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Protocol

import torch

from corelib.ops import SAMPLING_COLUMNS, SAMPLING_TABLES, PagedAttention, SamplingInputs, TokenHistory
from corelib.ops.sampling import CUT_NEUTRAL

LONG_CONTEXT = 1900
VOCAB = 151936
F32, BF16 = torch.float32, torch.bfloat16
#: what a case's build() returns: the op's arguments, in order (decode adds the live-slot mask)
Args = tuple[object, ...]


class Case(Protocol):
    def build(self, seed: int, device: torch.device) -> Args:
        """The op's arguments on ``device``; the same for the same seed on every device."""
        ...


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def ragged(batch: int, block_size: int, long: int) -> tuple[int, ...]:
    """Context lengths over the block edges; from 3 rows on, the last row is padding (length 1)."""
    pattern = [long, 1, block_size - 1, block_size, block_size + 1, 2 * block_size + 3, 5 * block_size - 1]
    lengths = list(itertools.islice(itertools.cycle(pattern), batch))
    if batch >= 3:
        lengths[-1] = 1
    return tuple(lengths)


@dataclass(frozen=True)
class DecodeCase:
    dtype: torch.dtype
    batch: int
    group: int  # query heads per KV head
    head_dim: int
    block_size: int
    long: int = LONG_CONTEXT
    kv_heads: int = 2
    lengths: tuple[int, ...] = ()  # default: ragged

    def seq_lengths(self) -> tuple[int, ...]:
        return self.lengths or ragged(self.batch, self.block_size, self.long)

    @property
    def width(self) -> int:
        """Block-table width: two padding columns (block 0) past the longest context."""
        return -(-max(self.long, *self.seq_lengths()) // self.block_size) + 2

    def build(self, seed: int, device: torch.device) -> Args:
        gen = torch.Generator().manual_seed(seed)
        bs, lengths, width = self.block_size, list(self.seq_lengths()), self.width
        if seed:  # other lengths on the same static shapes: a replayed graph must follow them
            lengths = [lengths[i] for i in torch.randperm(len(lengths), generator=gen).tolist()]
        padded = self.batch >= 3 and not self.lengths
        num_blocks = self.batch * width + 1
        kc = randn(gen, num_blocks, bs, self.kv_heads, self.head_dim, dtype=self.dtype)
        vc = randn(gen, num_blocks, bs, self.kv_heads, self.head_dim, dtype=self.dtype)
        owners = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 is the padding block
        tables = torch.zeros(self.batch, width, dtype=torch.int32)
        live = torch.zeros(num_blocks, bs, dtype=torch.bool)
        if padded:  # a padded row: one key, on block 0
            lengths[-1] = 1
        for row, length in enumerate(lengths):
            blocks = owners[row * width : row * width + -(-length // bs)]
            if padded and row == self.batch - 1:
                blocks = torch.zeros(1, dtype=torch.int64)
            tables[row, : len(blocks)] = blocks.to(torch.int32)
            live.view(-1)[(blocks[:, None] * bs + torch.arange(bs)).view(-1)[:length]] = True
        q = randn(gen, self.batch, self.kv_heads * self.group, self.head_dim, dtype=self.dtype)
        attn = PagedAttention(tables.to(device), torch.tensor(lengths, device=device), bs)
        return q.to(device), kc.to(device), vc.to(device), attn, self.head_dim**-0.5, live.to(device)


@dataclass(frozen=True)
class ChunkCase:
    """A step of query lengths >= 1 over the paged cache: rows as (cached context, query length).

    The step's own keys are in the cache already (the op reads only the cache); every slot past a
    row's end, and every block no row owns, is dead (the live mask, for poisoning).
    """

    dtype: torch.dtype
    group: int
    head_dim: int
    block_size: int
    rows: tuple[tuple[int, int], ...]  # (tokens cached before the step, queries in the step)
    kv_heads: int = 2
    split: bool = False  # name the leading one-query rows as decode rows (PagedAttention.decode_rows)

    def build(self, seed: int, device: torch.device) -> Args:
        # Another seed keeps every length (max_query_len is a host int) and draws new values and blocks.
        gen = torch.Generator().manual_seed(seed)
        bs, nkv, hd = self.block_size, self.kv_heads, self.head_dim
        lengths = [cached + queries for cached, queries in self.rows]
        width = max(-(-n // bs) for n in lengths) + 1  # one padding column (block 0)
        num_blocks = len(self.rows) * width + 1
        kc = randn(gen, num_blocks, bs, nkv, hd, dtype=self.dtype)
        vc = randn(gen, num_blocks, bs, nkv, hd, dtype=self.dtype)
        owners = torch.randperm(num_blocks - 1, generator=gen) + 1
        tables = torch.zeros(len(self.rows), width, dtype=torch.int32)
        live = torch.zeros(num_blocks, bs, dtype=torch.bool)
        for row, length in enumerate(lengths):
            blocks = owners[row * width : row * width + -(-length // bs)]
            tables[row, : len(blocks)] = blocks.to(torch.int32)
            live.view(-1)[(blocks[:, None] * bs + torch.arange(bs)).view(-1)[:length]] = True
        queries = [q for _, q in self.rows]
        q = randn(gen, sum(queries), nkv * self.group, hd, dtype=self.dtype)
        start = torch.tensor([0, *itertools.accumulate(queries)], dtype=torch.int64)
        leading = next((i for i, n in enumerate(queries) if n > 1), len(queries)) if self.split else 0
        attn = PagedAttention(tables.to(device), torch.tensor(lengths, device=device), bs, start.to(device),
                              max(queries), leading)
        return q.to(device), kc.to(device), vc.to(device), attn, hd**-0.5, live.to(device)


@dataclass(frozen=True)
class CapturedChunkCase:
    """A captured step (``PagedAttention.captured``): one of ``steps`` padded to ``tokens`` token slots and
    ``slots`` rows, the same shapes whichever step it holds.

    ``build(seed)`` holds ``steps[seed % len(steps)]``, so a graph captured on one step and replayed on
    another must follow query lengths it never saw. Rows past the step's are empty (seq_len 1 on
    block 0, no queries); the tokens past the step's belong to no row and must come out 0.
    """

    dtype: torch.dtype
    group: int
    head_dim: int
    block_size: int
    tokens: int
    slots: int
    steps: tuple[tuple[tuple[int, int], ...], ...]  # each: rows as (tokens cached before the step, queries)
    kv_heads: int = 2

    def build(self, seed: int, device: torch.device) -> Args:
        gen = torch.Generator().manual_seed(seed)
        bs, nkv, hd = self.block_size, self.kv_heads, self.head_dim
        rows = self.steps[seed % len(self.steps)]
        width = max(-(-(cached + queries) // bs) for step in self.steps for cached, queries in step) + 1
        num_blocks = self.slots * width + 1
        kc = randn(gen, num_blocks, bs, nkv, hd, dtype=self.dtype)
        vc = randn(gen, num_blocks, bs, nkv, hd, dtype=self.dtype)
        owners = torch.randperm(num_blocks - 1, generator=gen) + 1
        tables = torch.zeros(self.slots, width, dtype=torch.int32)
        live = torch.zeros(num_blocks, bs, dtype=torch.bool)
        live[0, 0] = True  # the padded rows' one key
        lengths = [cached + queries for cached, queries in rows] + [1] * (self.slots - len(rows))
        for row, length in enumerate(lengths[: len(rows)]):
            blocks = owners[row * width : row * width + -(-length // bs)]
            tables[row, : len(blocks)] = blocks.to(torch.int32)
            live.view(-1)[(blocks[:, None] * bs + torch.arange(bs)).view(-1)[:length]] = True
        queries = [q for _, q in rows]
        ends = list(itertools.accumulate(queries))
        start = torch.tensor([0, *ends, *[ends[-1]] * (self.slots - len(rows))], dtype=torch.int64)
        q = randn(gen, self.tokens, nkv * self.group, hd, dtype=self.dtype)
        attn = PagedAttention(tables.to(device), torch.tensor(lengths, device=device), bs, start.to(device),
                              self.tokens, 0, captured=True)
        return q.to(device), kc.to(device), vc.to(device), attn, hd**-0.5, live.to(device)


@dataclass(frozen=True)
class RopeCase:
    dtype: torch.dtype
    tokens: int
    group: int
    head_dim: int
    block_size: int
    kv_heads: int = 2

    def build(self, seed: int, device: torch.device) -> Args:
        gen = torch.Generator().manual_seed(seed)
        nkv, hd = self.kv_heads, self.head_dim
        nh = nkv * self.group
        qkv = randn(gen, self.tokens, (nh + 2 * nkv) * hd, dtype=self.dtype).to(device)
        positions, cos_sin, kc, vc, slots = rope_kv_inputs(gen, self.tokens, self.block_size, nkv, hd, self.dtype,
                                                           device)
        qk = qkv[:, : (nh + nkv) * hd].view(self.tokens, nh + nkv, hd)
        v = qkv[:, (nh + nkv) * hd :].view(self.tokens, nkv, hd)
        return qk, v, positions, cos_sin, kc, vc, slots


def cos_sin_table(gen: torch.Generator, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A RoPE table of 4096 positions [4096, 2, head_dim] (cos, sin) of random angles, on the CPU."""
    angles = torch.rand(4096, 1, head_dim, generator=gen) * 6.3
    return torch.cat((angles.cos(), angles.sin()), dim=1).to(dtype)


def rope_kv_inputs(gen: torch.Generator, tokens: int, block_size: int, kv_heads: int, head_dim: int,
                   dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """What RoPE and the KV write read beside the projection, for ``tokens`` tokens, on ``device``: positions,
    a cos/sin table of 4096 positions, key and value caches of a few blocks more than the tokens need, and a
    distinct cache slot per token."""
    cos_sin = cos_sin_table(gen, head_dim, dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    num_blocks = -(-tokens // block_size) + 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    kc = randn(gen, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    vc = randn(gen, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    return positions.to(device), cos_sin.to(device), kc.to(device), vc.to(device), slots.to(device)


@dataclass(frozen=True)
class NormCase:
    dtype: torch.dtype
    shape: tuple[int, ...]
    residual: bool = False
    per_head: bool = False  # x is [T, n, hd] read out of a wider fused output, as q/k norm does

    def build(self, seed: int, device: torch.device) -> Args:
        gen = torch.Generator().manual_seed(seed)
        if self.per_head:
            tokens, heads, hd = self.shape
            x = randn(gen, tokens, 3 * heads * hd, dtype=self.dtype).to(device)[:, : heads * hd].view(self.shape)
        else:
            x = randn(gen, *self.shape, dtype=self.dtype).to(device)
        residual = randn(gen, *self.shape, dtype=self.dtype).to(device) if self.residual else None
        weight = (1.0 + 0.1 * randn(gen, self.shape[-1])).to(self.dtype).to(device)
        return x, weight, 1e-6, residual


@dataclass(frozen=True)
class SiluCase:
    dtype: torch.dtype
    tokens: int
    inter: int

    def build(self, seed: int, device: torch.device) -> Args:
        gen = torch.Generator().manual_seed(seed)
        return (randn(gen, self.tokens, 2 * self.inter, dtype=self.dtype).to(device),)


@dataclass(frozen=True)
class SampleCase:
    batch: int
    vocab: int = VOCAB
    ties: bool = False  # logits from bfloat16 values: many equal maxima
    sampled: bool = False  # every sampling column's example values cycled over the rows, a token history
    argmax: bool = False  # as sampled, but every row greedy and the step known not to draw (the processed argmax)
    uncut: bool = False  # as sampled, but no row has a cut and the step is known to sort nothing (noise and argmax)

    def build(self, seed: int, device: torch.device) -> Args:
        gen = torch.Generator().manual_seed(seed)
        logits = randn(gen, self.batch, self.vocab) * 3
        if self.ties:
            logits = logits.round()  # small integers: the maximum repeats in every row
        sampling = None
        if self.sampled or self.argmax or self.uncut:
            # Each column cycles through its examples (column i shifted by i rows, so rows mix them);
            # a column without examples (the seeds) draws integers.
            columns = {}
            for shift, column in enumerate(SAMPLING_COLUMNS):
                if (self.uncut and column.name in CUT_NEUTRAL) or (self.argmax and column.name == "temperature"):
                    columns[column.name] = torch.full((self.batch,), column.neutral, dtype=column.dtype).to(device)
                elif column.examples:
                    rows = (torch.arange(self.batch) + shift) % len(column.examples)
                    columns[column.name] = torch.tensor(column.examples, dtype=column.dtype)[rows].to(device)
                else:
                    columns[column.name] = torch.randint(0, 2**40, (self.batch,), generator=gen).to(device)
            # Sequence i's history sits at state index batch - 1 - i, past some unused states.
            states = self.batch + 2
            history = TokenHistory(
                torch.randint(0, 3, (states, self.vocab), generator=gen, dtype=torch.int32).to(device),
                torch.randint(0, 2, (states, self.vocab), generator=gen, dtype=torch.int32).to(device),
                torch.arange(self.batch - 1, -1, -1).to(device),
            )
            positions = torch.randint(0, 4096, (self.batch,), generator=gen).to(device)
            # Tables: row i biases i % 4 distinct tokens (by 2.5, -100: a ban, 100: all but forced) and has i % 3
            # stop ids, banned while its outputs (position - prompt length: 0 to 3 here) are below min_tokens.
            widths = {t.name: t.width for t in SAMPLING_TABLES}
            bias_ids = torch.zeros((self.batch, widths["bias_ids"]), dtype=torch.int64)
            bias_values = torch.zeros((self.batch, widths["bias_values"]), dtype=torch.float32)
            stop_ids = torch.full((self.batch, widths["stop_ids"]), -1, dtype=torch.int64)
            for row in range(self.batch):
                ids = torch.randperm(self.vocab, generator=gen)[: row % 4 + row % 3]
                bias_ids[row, : row % 4] = ids[: row % 4]
                bias_values[row, : row % 4] = torch.tensor((2.5, -100.0, 100.0)[: row % 4])
                stop_ids[row, : row % 3] = ids[row % 4 :]
            prompt_lens = positions - torch.randint(0, 4, (self.batch,), generator=gen).to(device)
            tables = {"bias_ids": bias_ids.to(device), "bias_values": bias_values.to(device),
                      "stop_ids": stop_ids.to(device)}
            sampling = SamplingInputs.of(positions, history, prompt_lens, **columns, **tables)
            if self.argmax or self.uncut:
                sampling = dataclasses.replace(sampling, draws=not self.argmax, cuts=False)
        return logits.to(device), sampling


@dataclass(frozen=True)
class SamplePublishCase:
    """``sample_publish``'s arguments: a SampleCase's, where the host's copy goes, the relay and its slots.

    ``nonfinite``: row 1 holds a NaN in its last 4,096 ids, row 2 an inf at its largest logit, row 4 one -inf
    (rows that exist); the outputs are filled with -7 first, so an unwritten entry shows."""

    batch: int
    vocab: int = VOCAB
    nonfinite: bool = False
    sampled: bool = False

    def build(self, seed: int, device: torch.device) -> Args:
        logits, sampling = SampleCase(self.batch, self.vocab, sampled=self.sampled).build(seed, device)
        assert isinstance(logits, torch.Tensor)
        if self.nonfinite:
            gen = torch.Generator().manual_seed(seed + 1)
            spots = torch.randint(0, self.vocab, (self.batch,), generator=gen).tolist()
            for row, value in ((1, float("nan")), (2, float("inf")), (4, float("-inf"))):
                if row < self.batch:
                    col = self.vocab - 1 - spots[row] % 4096 if row == 1 else spots[row]
                    if row == 2:
                        col = int(logits[row].argmax())
                    logits[row, col] = value
        slots = torch.randperm(self.batch + 3, generator=torch.Generator().manual_seed(seed))[: self.batch]
        checked = torch.full((self.batch,), -7, dtype=torch.int64)
        relay = torch.full((self.batch + 3,), -7, dtype=torch.int64)
        return logits, sampling, checked.to(device), relay.to(device), slots.to(device)


@dataclass(frozen=True)
class RelayCase:
    """``relay_inputs``' arguments: ``tokens`` input ids, every third one relayed (negative) from one of
    ``states`` state indices, each fed to its own KV slot of ``slots`` (the others hold -7, unwritten)."""

    tokens: int
    states: int = 9
    slots: int = 4096

    def build(self, seed: int, device: torch.device) -> Args:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, VOCAB, (self.tokens,), generator=gen)
        ids[::3] = -1
        relay = torch.randint(0, VOCAB, (self.states,), generator=gen)
        states = torch.randint(0, self.states, (self.tokens,), generator=gen)
        slot_tokens = torch.full((self.slots,), -7, dtype=torch.int64)
        slot_mapping = torch.randperm(self.slots, generator=gen)[: self.tokens]
        return tuple(t.to(device) for t in (ids, relay, states, slot_tokens, slot_mapping))


def case_id(case: object) -> str:
    """The fields a case sets, e.g. ``bfloat16-batch3-group8-head_dim128-block_size32-long300``."""
    parts = []
    for f in dataclasses.fields(case):  # type: ignore[arg-type]
        value = getattr(case, f.name)
        if isinstance(value, torch.dtype):
            parts.append(str(value).removeprefix("torch."))
        elif value is True:
            parts.append(f.name)
        elif f.default is dataclasses.MISSING or (value != f.default and value is not False):
            text = "x".join(map(str, value)) if isinstance(value, tuple) else str(value)
            parts.append(f"{f.name}{text}")
    return "-".join(parts)
