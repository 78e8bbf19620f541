"""The step wire protocol: how one step's inputs and results are laid out, in process and over SHM.

Everything both ends of the SHM transport must agree on is defined here once, by name:

- the arena layouts of a step's inputs (:func:`decode_layout`, :func:`prefill_layout`): named
  tensors at 64-byte aligned offsets in one uint8 buffer, so one H2D copy moves a whole step
  and the same bytes travel through the ring unchanged;
- the frame kinds, and one flag set per direction (:class:`InputFlags` on input frames,
  :class:`ResultFlags` on result frames);
- the frame header (:class:`FrameHeader`), and the payload of a result frame
  (:func:`encode_result` / :func:`decode_result`).

The scheduler side and the worker side both import this module; neither imports the other.
"""

from __future__ import annotations

import enum
import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import crc32c
import torch

from corelib.backend import DeviceSpec
from corelib.config import CorelibConfig
from corelib.engine.options import EngineOptions
from corelib.errors import TransportError
from corelib.ops import SAMPLING_COLUMNS

ALIGN = 64
RELAY = -1  # a decode row's input id: take the token from the device relay, not from the host

_DTYPE_CODES: dict[torch.dtype, int] = {torch.int64: 0, torch.int32: 1, torch.float32: 2, torch.bool: 3}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
_ITEM_BYTES = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in _DTYPE_CODES}


# ---------------------------------------------------------------------------------------- arenas
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
        return count * _ITEM_BYTES[self.dtype]


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

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def views(self, arena: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views into ``arena`` (host or device); writes go straight to the arena."""
        if arena.dtype != torch.uint8 or arena.numel() < self.nbytes:
            raise ValueError(f"arena must be uint8 with at least {self.nbytes} bytes")
        out = {}
        for f, offset in zip(self.fields, self.offsets, strict=True):
            out[f.name] = arena[offset : offset + f.nbytes].view(f.dtype).view(f.shape)
        return out

    def encode(self) -> list[int]:
        """The layout as integers, for a frame header: per field a dtype code, rank and dims (a new list)."""
        return list(self._words)

    @functools.cached_property
    def _words(self) -> tuple[int, ...]:
        words = [len(self.fields)]
        for f in self.fields:
            words += [_DTYPE_CODES[f.dtype], len(f.shape), *f.shape]
        return tuple(words)

    @classmethod
    def decode(cls, names: Sequence[str], words: Sequence[int]) -> ArenaLayout:
        """The layout a header describes, its fields named by the frame kind's field names."""
        if not words:
            raise ValueError("the frame carries no layout")
        count, cursor = words[0], 1
        if count != len(names):
            raise ValueError(f"layout has {count} fields; expected {len(names)}")
        fields = []
        for name in names:
            if cursor + 2 > len(words):
                raise ValueError(f"layout ends before field {name!r}")
            code, rank = words[cursor], words[cursor + 1]
            dims = tuple(words[cursor + 2 : cursor + 2 + rank])
            cursor += 2 + rank
            if code not in _CODE_DTYPES:
                raise ValueError(f"field {name!r} has unknown dtype code {code}")
            if len(dims) != rank or any(d < 0 for d in dims):
                raise ValueError(f"field {name!r} has a malformed shape {dims}")
            fields.append(Field(name, _CODE_DTYPES[code], dims))
        return cls.of(fields)


# One row per sequence of a decode step (R = the engine's largest batch), plus its block table.
DECODE_FIELDS: tuple[tuple[str, torch.dtype], ...] = (
    ("input_ids", torch.int64),  # RELAY: the token sampled by the previous step, on the device
    ("positions", torch.int64),
    ("slot_mapping", torch.int64),  # KV cache slot of the new token: block * block_size + offset
    ("seq_lens", torch.int64),  # keys to attend to, the new token included
    ("state_indices", torch.int64),  # per-sequence slot: token relay, recurrent state
    *((column.name, column.dtype) for column in SAMPLING_COLUMNS),
)
DECODE_FIELD_NAMES = (*(name for name, _ in DECODE_FIELDS), "block_tables")

# A prefill step: its tokens packed flat (T), and one row per sequence (n).
PREFILL_TOKEN_FIELDS = ("token_ids", "positions", "slot_mapping")
PREFILL_SEQ_FIELDS: tuple[tuple[str, torch.dtype], ...] = (
    ("last_index", torch.int64),  # index of each sequence's last token in the flat tokens
    ("state_indices", torch.int64),
    *((column.name, column.dtype) for column in SAMPLING_COLUMNS),
)
PREFILL_FIELD_NAMES = (
    *PREFILL_TOKEN_FIELDS, "cu_seqlens", "pad_index", "valid", *(name for name, _ in PREFILL_SEQ_FIELDS)
)


def decode_layout(max_rows: int, max_blocks: int) -> ArenaLayout:
    fields = [Field(name, dtype, (max_rows,)) for name, dtype in DECODE_FIELDS]
    return ArenaLayout.of([*fields, Field("block_tables", torch.int32, (max_rows, max_blocks))])


def prefill_layout(num_tokens: int, num_seqs: int, max_len: int) -> ArenaLayout:
    return ArenaLayout.of(
        [
            *(Field(name, torch.int64, (num_tokens,)) for name in PREFILL_TOKEN_FIELDS),
            Field("cu_seqlens", torch.int64, (num_seqs + 1,)),
            Field("pad_index", torch.int64, (num_seqs, max_len)),
            Field("valid", torch.bool, (num_seqs, max_len)),
            *(Field(name, dtype, (num_seqs,)) for name, dtype in PREFILL_SEQ_FIELDS),
        ]
    )


# ---------------------------------------------------------------------------------------- frames
class FrameKind(enum.IntEnum):
    prefill = 0
    decode = 1
    result = 2
    stop = 3
    memory = 5  # asks each worker for its device's memory figures (answered on the control pipe)


class InputFlags(enum.IntFlag):
    """Flags of a prefill or decode frame."""

    NONE = 0
    SAMPLE = 1  # some row samples (temperature > 0): the sampled graph variant runs


class ResultFlags(enum.IntFlag):
    """Flags of a result frame."""

    NONE = 0
    GRAPH = 1  # the step replayed a captured graph
    DECODE = 2  # a decode step (else prefill)


def field_names(kind: FrameKind) -> tuple[str, ...]:
    if kind is FrameKind.decode:
        return DECODE_FIELD_NAMES
    if kind is FrameKind.prefill:
        return PREFILL_FIELD_NAMES
    raise TransportError(f"a {kind.name} frame carries no step inputs")


MAGIC = 0x434F524C  # "CORL"
VERSION = 4  # 4: CRC-32C; 3: named input fields; 2: the checksum covers the header too
HEADER_BYTES = 1024  # the payload starts here, 64-byte aligned
MAX_LAYOUT_WORDS = 96
_FIXED = struct.Struct("<IHHQqiiiiddQII")
_CHECKSUM_AT = struct.calcsize("<IHHQqiiiiddQ")  # the checksum's offset: the CRC reads it as zero
_ZERO_CHECKSUM = bytes(4)
_LAYOUTS: dict[tuple[int, ...], ArenaLayout] = {}  # input layouts by frame kind and layout words


def frame_crc(header: memoryview, header_bytes: int, payload: memoryview) -> int:
    """CRC-32C of a packed header (its checksum field read as zero) followed by the payload."""
    crc = crc32c.crc32c(header[:_CHECKSUM_AT])
    crc = crc32c.crc32c(_ZERO_CHECKSUM, crc)
    crc = crc32c.crc32c(header[_CHECKSUM_AT + 4 : header_bytes], crc)
    return int(crc32c.crc32c(payload, crc))


@dataclass
class FrameHeader:
    kind: FrameKind
    seq: int  # frame number within the ring, from 0
    step_id: int = -1
    num_seqs: int = 0
    bucket: int = 0
    kv_blocks: int = 0
    flags: int = 0  # InputFlags on input frames, ResultFlags on result frames
    sent_at: float = 0.0  # time.perf_counter() of the producer (CLOCK_MONOTONIC, shared by processes)
    value: float = 0.0  # a free float
    payload_len: int = 0
    checksum: int = 0
    layout: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return _FIXED.size + 8 * len(self.layout)

    def _fixed(self, checksum: int) -> tuple[int | float, ...]:
        if len(self.layout) > MAX_LAYOUT_WORDS:
            raise TransportError(f"frame layout has {len(self.layout)} words; at most {MAX_LAYOUT_WORDS} fit")
        return (MAGIC, VERSION, int(self.kind), self.seq, self.step_id, self.num_seqs, self.bucket,
                self.kv_blocks, int(self.flags), self.sent_at, self.value, self.payload_len, checksum,
                len(self.layout))

    def packed(self, checksum: int | None = None) -> bytes:
        fixed = _FIXED.pack(*self._fixed(self.checksum if checksum is None else checksum))
        return fixed + struct.pack(f"<{len(self.layout)}q", *self.layout)

    def pack_into(self, buffer: memoryview) -> None:
        """Write the packed header at the start of ``buffer`` (a slot's header area)."""
        _FIXED.pack_into(buffer, 0, *self._fixed(self.checksum))
        struct.pack_into(f"<{len(self.layout)}q", buffer, _FIXED.size, *self.layout)

    def crc(self, payload: memoryview | bytes) -> int:
        """CRC-32C of the header (its checksum field as zero) followed by the payload."""
        return int(crc32c.crc32c(payload, crc32c.crc32c(self.packed(0))))

    @classmethod
    def unpack_from(cls, buffer: memoryview, where: str) -> FrameHeader:
        (magic, version, kind, seq, step_id, num_seqs, bucket, kv_blocks, flags, sent_at, value, payload_len,
         checksum, words) = _FIXED.unpack_from(buffer, 0)
        if magic != MAGIC:
            raise TransportError(f"{where}: bad magic 0x{magic:08x} (not a corelib frame, or overwritten)")
        if version != VERSION:
            raise TransportError(f"{where}: frame version {version}, this corelib speaks version {VERSION}")
        if kind not in _KINDS:
            raise TransportError(f"{where}: unknown frame kind {kind}")
        if words > MAX_LAYOUT_WORDS:
            raise TransportError(f"{where}: layout of {words} words is longer than {MAX_LAYOUT_WORDS}")
        layout = list(struct.unpack_from(f"<{words}q", buffer, _FIXED.size)) if words else []
        return cls(_KINDS[kind], seq, step_id, num_seqs, bucket, kv_blocks, flags, sent_at, value,
                   payload_len, checksum, layout)

    def input_layout(self, where: str) -> ArenaLayout:
        """The arena layout of an input frame; a TransportError names the frame when it is malformed.

        Decoded once per distinct layout: a decode step's layout never changes, so a worker
        looks it up rather than rebuilding it every step.
        """
        key = (int(self.kind), *self.layout)
        layout = _LAYOUTS.get(key)
        if layout is None:
            try:
                layout = ArenaLayout.decode(field_names(self.kind), self.layout)
            except ValueError as error:
                raise TransportError(f"{where}: {error}") from None
            if len(_LAYOUTS) < MAX_CACHED_LAYOUTS:
                _LAYOUTS[key] = layout
        if layout.nbytes > self.payload_len:
            raise TransportError(f"{where}: payload of {self.payload_len} bytes is shorter than its layout "
                                 f"({layout.nbytes} bytes)")
        return layout


MAX_CACHED_LAYOUTS = 256  # prefill layouts vary with the step's lengths: keep the cache bounded
_KINDS = {int(kind): kind for kind in FrameKind}


# ---------------------------------------------------------------------------------------- results
RESULT_TAIL = struct.Struct("<ddd")  # busy ms, gap ms (-1: none), transport µs


@dataclass(frozen=True)
class WireResult:
    """What a result frame carries for one step."""

    step_id: int
    decode: bool
    graph: bool
    tokens: list[int]
    busy_ms: float | None
    gap_ms: float | None
    transport_us: float


def result_bytes(max_rows: int) -> int:
    return 8 * max_rows + RESULT_TAIL.size


def result_header(result: WireResult, sent_at: float) -> FrameHeader:
    flags = (ResultFlags.GRAPH if result.graph else ResultFlags.NONE) | (
        ResultFlags.DECODE if result.decode else ResultFlags.NONE)
    return FrameHeader(FrameKind.result, 0, result.step_id, len(result.tokens), flags=int(flags), sent_at=sent_at)


def encode_result(result: WireResult) -> bytes:
    tokens = struct.pack(f"<{len(result.tokens)}q", *result.tokens)
    gap = -1.0 if result.gap_ms is None else result.gap_ms
    return tokens + RESULT_TAIL.pack(result.busy_ms or 0.0, gap, result.transport_us)


def decode_result(header: FrameHeader, payload: bytes | memoryview) -> WireResult:
    n = header.num_seqs
    if len(payload) < 8 * n + RESULT_TAIL.size:
        raise TransportError(f"result frame for step {header.step_id}: {len(payload)} bytes cannot hold {n} tokens")
    tokens = list(struct.unpack_from(f"<{n}q", payload, 0))
    busy, gap, transport = RESULT_TAIL.unpack_from(payload, 8 * n)
    flags = ResultFlags(header.flags)
    return WireResult(header.step_id, ResultFlags.DECODE in flags, ResultFlags.GRAPH in flags, tokens,
                      busy or None, None if gap < 0 else gap, transport)


# ---------------------------------------------------------------------------------------- worker start
@dataclass
class WorkerArgs:
    """Everything a worker needs; pickled into the spawned process."""

    rank: int
    world_size: int
    config: CorelibConfig
    spec: DeviceSpec
    options: EngineOptions
    input_ring: str
    result_ring: str
    num_slots: int
    slot_bytes: int
    result_slot_bytes: int
    doorbell_fd: int  # eventfd this rank sleeps on for input frames (and the scheduler's demand)
    release_fd: int  # eventfd the scheduler sleeps on for released input slots
    result_doorbell_fd: int  # eventfd the scheduler sleeps on for results (rank 0; -1 elsewhere)
    result_release_fd: int  # eventfd rank 0 sleeps on for released result slots (rank 0; -1 elsewhere)
    control_fd: int  # write: ready / error / memory messages (a pipe: its end also shows an exit)
    parent_pid: int
    register_host: bool
    master_address: str = "127.0.0.1"  # tensor parallelism: the process group's rendezvous
    master_port: int = 0
    local_rank: int = 0  # this rank's place on its node: its device index and its consumer index in the ring
    local_world: int = 1  # ranks on this node (engine.tp / nodes): the ring's consumers
