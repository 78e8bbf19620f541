"""ForwardInput: one step's inputs packed into a single aligned byte arena.

One arena per step means one host-to-device copy per step, and the same bytes travel
through the SHM ring unchanged. The decode layout is fixed (rows for the largest batch,
columns for the longest sequence), so captured graphs read static device views of it;
prefill layouts are sized per step (prefill runs eagerly).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from corelib.device import Event
from corelib.engine.scheduler import ScheduledStep, StepKind
from corelib.engine.sequence import Sequence as EngineSequence

ALIGN = 64

# Per-row int64 fields of a decode step, stored as rows of one [F, R] matrix so that the host
# fills them with a single tensor conversion.
DECODE_INT_ROWS = ("input_ids", "positions", "slot_mapping", "seq_lens", "state_indices", "top_k", "seeds")
DECODE_FLOAT_ROWS = ("temperature", "top_p")
PREFILL_ROWS = ("last_index", "state_indices", "top_k", "seeds")
RELAY = -1  # input_ids value: take the token from the device relay, not from the host

_DTYPE_CODES: dict[torch.dtype, int] = {torch.int64: 0, torch.int32: 1, torch.float32: 2, torch.bool: 3}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


@dataclass(frozen=True)
class Field:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class ArenaLayout:
    """Named tensors at 64-byte aligned offsets in one uint8 buffer."""

    fields: tuple[Field, ...]
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, fields: Sequence[Field]) -> ArenaLayout:
        offsets = []
        cursor = 0
        for f in fields:
            offsets.append(cursor)
            cursor += -(-f.nbytes // ALIGN) * ALIGN
        return cls(tuple(fields), tuple(offsets), max(cursor, ALIGN))

    def views(self, arena: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views into ``arena`` (host or device); writes go straight to the arena."""
        if arena.dtype != torch.uint8 or arena.numel() < self.nbytes:
            raise ValueError(f"arena must be uint8 with at least {self.nbytes} bytes")
        out = {}
        for f, offset in zip(self.fields, self.offsets, strict=True):
            out[f.name] = arena[offset : offset + f.nbytes].view(f.dtype).view(f.shape)
        return out

    def encode(self) -> list[int]:
        """The layout as integers, for a frame header: per field a dtype code, rank and dims."""
        words = [len(self.fields)]
        for f in self.fields:
            words += [_DTYPE_CODES[f.dtype], len(f.shape), *f.shape]
        return words

    @classmethod
    def decode(cls, names: Sequence[str], words: Sequence[int]) -> ArenaLayout:
        count, cursor = words[0], 1
        if count != len(names):
            raise ValueError(f"layout has {count} fields; expected {len(names)}")
        fields = []
        for name in names:
            code, rank = words[cursor], words[cursor + 1]
            dims = tuple(words[cursor + 2 : cursor + 2 + rank])
            cursor += 2 + rank
            if code not in _CODE_DTYPES:
                raise ValueError(f"field {name!r} has unknown dtype code {code}")
            fields.append(Field(name, _CODE_DTYPES[code], dims))
        return cls.of(fields)


def decode_layout(max_rows: int, max_blocks: int) -> ArenaLayout:
    return ArenaLayout.of(
        [
            Field("ints", torch.int64, (len(DECODE_INT_ROWS), max_rows)),
            Field("floats", torch.float32, (len(DECODE_FLOAT_ROWS), max_rows)),
            Field("block_tables", torch.int32, (max_rows, max_blocks)),
        ]
    )


PREFILL_FIELD_NAMES = ("token_ids", "positions", "slot_mapping", "pad_index", "valid", "rows", "floats")


def prefill_layout(num_tokens: int, num_seqs: int, max_len: int) -> ArenaLayout:
    return ArenaLayout.of(
        [
            Field("token_ids", torch.int64, (num_tokens,)),
            Field("positions", torch.int64, (num_tokens,)),
            Field("slot_mapping", torch.int64, (num_tokens,)),
            Field("pad_index", torch.int64, (num_seqs, max_len)),
            Field("valid", torch.bool, (num_seqs, max_len)),
            Field("rows", torch.int64, (len(PREFILL_ROWS), num_seqs)),
            Field("floats", torch.float32, (len(DECODE_FLOAT_ROWS), num_seqs)),
        ]
    )


def row_views(views: dict[str, torch.Tensor], names: Sequence[str], key: str) -> dict[str, torch.Tensor]:
    """Name the rows of a stacked [F, R] field."""
    return {name: views[key][i] for i, name in enumerate(names)}


@dataclass
class ForwardInput:
    """One step's packed inputs and the shape of the work they describe."""

    step_id: int
    kind: StepKind
    num_seqs: int
    bucket: int  # decode: rows the device computes (>= num_seqs, padded); prefill: num_seqs
    kv_blocks: int  # decode: block-table columns read
    sample: bool  # some row samples (temperature > 0); else greedy
    layout: ArenaLayout
    arena: torch.Tensor  # uint8 host buffer holding layout.nbytes bytes
    # Called once the device can no longer read ``arena`` (the step's output event completed).
    on_release: Callable[[], None] | None = None
    on_device: bool = False  # ``arena`` is device memory already (early SHM materialization)
    ready: Event | None = None  # with on_device: completes when the early H2D has landed

    def release(self) -> None:
        callback, self.on_release = self.on_release, None
        if callback is not None:
            callback()

    def views(self) -> dict[str, torch.Tensor]:
        return self.layout.views(self.arena)


class InputBuilder:
    """Packs a ScheduledStep into an arena. Runs on the scheduler side: no device needed.

    Per-slot values that change rarely (block tables, sampling settings) live in host
    tables updated only when they change, so packing a decode step is a few vector ops.
    """

    def __init__(
        self, max_rows: int, max_blocks: int, block_size: int, pad_slot: int, max_model_len: int
    ) -> None:
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.pad_slot = pad_slot
        self.max_model_len = max_model_len
        self.decode = decode_layout(max_rows, max_blocks)
        slots = pad_slot + 1
        self.slot_tables = torch.zeros((slots, max_blocks), dtype=torch.int32)
        self.slot_ints = torch.zeros((2, slots), dtype=torch.int64)  # top_k, seed
        self.slot_floats = torch.zeros((2, slots), dtype=torch.float32)  # temperature, top_p
        self.slot_floats[1] = 1.0
        self._owners: list[tuple[int, int, int]] = [(-1, -1, 0)] * slots  # seq_id, blocks_epoch, blocks written

    def prefill_layout(self, step: ScheduledStep) -> ArenaLayout:
        lengths = [seq.num_tokens for seq in step.seqs]
        return prefill_layout(sum(lengths), len(lengths), max(lengths))

    def layout_for(self, step: ScheduledStep) -> ArenaLayout:
        return self.decode if step.kind is StepKind.decode else self.prefill_layout(step)

    def _slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _sync_slot(self, seq: EngineSequence, slot: int) -> None:
        """Bring the slot's cached block table and sampling values up to date with ``seq``."""
        owner, epoch, written = self._owners[slot]
        table = seq.block_table
        if owner != seq.seq_id or epoch != seq.blocks_epoch:
            sampling = seq.sampling
            self.slot_ints[0, slot] = sampling.top_k
            self.slot_ints[1, slot] = sampling.seed
            self.slot_floats[0, slot] = sampling.temperature
            self.slot_floats[1, slot] = sampling.top_p
            written = 0
        if written < len(table):
            self.slot_tables[slot, written : len(table)] = torch.tensor(table[written:], dtype=torch.int32)
            written = len(table)
        self._owners[slot] = (seq.seq_id, seq.blocks_epoch, written)

    def fill(self, step_id: int, step: ScheduledStep, arena: torch.Tensor, bucket: int, kv_blocks: int) -> ForwardInput:
        if step.kind is StepKind.decode:
            return self._fill_decode(step_id, step, arena, bucket, kv_blocks)
        return self._fill_prefill(step_id, step, arena)

    def _fill_decode(
        self, step_id: int, step: ScheduledStep, arena: torch.Tensor, bucket: int, kv_blocks: int
    ) -> ForwardInput:
        n = len(step.seqs)
        views = self.decode.views(arena)
        ints, floats, tables = views["ints"], views["floats"], views["block_tables"]
        slots: list[int] = []
        ids: list[int] = []
        for seq, position, relay in zip(step.seqs, step.positions, step.from_relay, strict=True):
            slot = seq.slot if seq.slot is not None else self.pad_slot
            self._sync_slot(seq, slot)
            slots.append(slot)
            ids.append(RELAY if relay else seq.token_at(position))
        slot_t = torch.tensor(slots, dtype=torch.int64)
        positions = torch.tensor(step.positions, dtype=torch.int64)
        ints[0, :n] = torch.tensor(ids, dtype=torch.int64)
        ints[1, :n] = positions
        block = self.slot_tables[slot_t, positions // self.block_size].to(torch.int64)
        ints[2, :n] = block * self.block_size + positions % self.block_size
        ints[3, :n] = positions + 1
        ints[4, :n] = slot_t
        ints[5:7, :n] = self.slot_ints[:, slot_t]
        floats[:, :n] = self.slot_floats[:, slot_t]
        tables[:n, :kv_blocks] = self.slot_tables[slot_t, :kv_blocks]
        if bucket > n:  # padded rows: token 0 at position 0, written to the null block
            ints[:, n:bucket] = 0
            ints[3, n:bucket] = 1
            ints[4, n:bucket] = self.pad_slot
            floats[0, n:bucket] = 0.0
            floats[1, n:bucket] = 1.0
            tables[n:bucket, :kv_blocks] = 0
        sample = any(s.sampling.temperature > 0 for s in step.seqs)
        return ForwardInput(step_id, StepKind.decode, n, bucket, kv_blocks, sample, self.decode, arena)

    def fill_padding(self, arena: torch.Tensor, rows: int, kv_blocks: int) -> None:
        """A decode arena whose first ``rows`` rows are all padding (for graph capture)."""
        views = self.decode.views(arena)
        views["ints"].zero_()
        views["ints"][3] = 1
        views["ints"][4] = self.pad_slot
        views["floats"][0] = 0.0
        views["floats"][1] = 1.0
        views["block_tables"].zero_()

    def _fill_prefill(self, step_id: int, step: ScheduledStep, arena: torch.Tensor) -> ForwardInput:
        layout = self.prefill_layout(step)
        views = layout.views(arena)
        tokens: list[int] = []
        slots: list[int] = []
        lengths = []
        for seq in step.seqs:
            ids = seq.all_token_ids()
            tokens += ids
            slots += [self._slot(seq.block_table, p) for p in range(len(ids))]
            lengths.append(len(ids))
        n, longest = len(lengths), max(lengths)
        views["token_ids"].copy_(torch.tensor(tokens, dtype=torch.int64))
        views["positions"].copy_(torch.cat([torch.arange(length) for length in lengths]))
        views["slot_mapping"].copy_(torch.tensor(slots, dtype=torch.int64))
        length_t = torch.tensor(lengths, dtype=torch.int64)
        starts = torch.cumsum(length_t, 0) - length_t
        columns = torch.arange(longest)
        valid = columns[None, :] < length_t[:, None]
        views["valid"].copy_(valid)
        views["pad_index"].copy_(torch.where(valid, starts[:, None] + columns[None, :], 0))
        views["rows"].copy_(
            torch.tensor(
                [
                    [length - 1 for length in lengths],
                    [seq.slot if seq.slot is not None else self.pad_slot for seq in step.seqs],
                    [seq.sampling.top_k for seq in step.seqs],
                    [seq.sampling.seed for seq in step.seqs],
                ],
                dtype=torch.int64,
            )
        )
        views["floats"].copy_(
            torch.tensor(
                [[s.sampling.temperature for s in step.seqs], [s.sampling.top_p for s in step.seqs]],
                dtype=torch.float32,
            )
        )
        sample = any(s.sampling.temperature > 0 for s in step.seqs)
        return ForwardInput(step_id, StepKind.prefill, n, n, 0, sample, layout, arena)
