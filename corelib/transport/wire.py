"""The step wire protocol: how one step's inputs and results are laid out, in process and over SHM.

Everything both ends of the SHM transport must agree on is defined here once, by name (the
arena layouts of a step's inputs, which frames carry unchanged, are :mod:`corelib.step.arena`):

- the frame kinds, and one flag set per direction (:class:`InputFlags` on input frames,
  :class:`ResultFlags` on result frames);
- the frame header (:class:`FrameHeader`), and the payload of a result frame
  (:func:`encode_result` / :func:`decode_result`).

The scheduler side and the worker side both import this module; neither imports the other.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field

import crc32c

from corelib.errors import TransportError
from corelib.step.arena import DECODE_FIELD_NAMES, PREFILL_FIELD_NAMES, ArenaLayout
from corelib.step.forward_input import ForwardInput, StepKind


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
# 6: the penalties' columns, prefill prompt lengths; 5: no free float; 4: CRC-32C; 3: named input fields;
# 2: the checksum covers the header too
VERSION = 6
HEADER_BYTES = 1024  # the payload starts here, 64-byte aligned
MAX_LAYOUT_WORDS = 96
_FIXED = struct.Struct("<IHHQqiiiidQII")
_CHECKSUM_AT = struct.calcsize("<IHHQqiiiidQ")  # the checksum's offset: the CRC reads it as zero
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
                self.kv_blocks, int(self.flags), self.sent_at, self.payload_len, checksum,
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
        (magic, version, kind, seq, step_id, num_seqs, bucket, kv_blocks, flags, sent_at, payload_len, checksum,
         words) = _FIXED.unpack_from(buffer, 0)
        if magic != MAGIC:
            raise TransportError(f"{where}: bad magic 0x{magic:08x} (not a corelib frame, or overwritten)")
        if version != VERSION:
            raise TransportError(f"{where}: frame version {version}, this corelib speaks version {VERSION}")
        if kind not in _KINDS:
            raise TransportError(f"{where}: unknown frame kind {kind}")
        if words > MAX_LAYOUT_WORDS:
            raise TransportError(f"{where}: layout of {words} words is longer than {MAX_LAYOUT_WORDS}")
        layout = list(struct.unpack_from(f"<{words}q", buffer, _FIXED.size)) if words else []
        return cls(_KINDS[kind], seq, step_id, num_seqs, bucket, kv_blocks, flags, sent_at, payload_len, checksum,
                   layout)

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


def input_header(fi: ForwardInput, sent_at: float) -> FrameHeader:
    """The header of the input frame that carries step ``fi`` (its arena is the payload)."""
    kind = FrameKind.decode if fi.kind is StepKind.decode else FrameKind.prefill
    flags = InputFlags.SAMPLE if fi.sample else InputFlags.NONE
    return FrameHeader(kind, 0, fi.step_id, fi.num_seqs, fi.bucket, fi.kv_blocks, int(flags), sent_at=sent_at,
                       layout=fi.layout.encode())


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
