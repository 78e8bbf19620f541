"""The SHM wire protocol: the frames that carry a step's inputs and its results between processes.

Everything both ends of the SHM transport must agree on is defined here once, by name, but the step
layout a step frame carries (:mod:`corelib.step.fields`, which the packer and the runner share in
process too):

- the frame kinds, and one flag set per direction (:class:`InputFlags` on input frames,
  :class:`ResultFlags` on result frames);
- the frame header (:class:`FrameHeader`), and the payload of a result frame
  (:func:`encode_result` / :func:`decode_result`).

The scheduler side and the worker side both import this module; neither imports the other.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import crc32c
import torch

from corelib.errors import TransportError
from corelib.step.arena import ArenaLayout
from corelib.step.fields import LOGPROB_WIDTH, PROMPT_LOGPROBS, STEP_FIELD_NAMES, TOKEN_MASK
from corelib.step.forward_input import ForwardInput, StepKind
from corelib.step.handoff import StepResult


# ---------------------------------------------------------------------------------------- frames
class FrameKind(enum.IntEnum):
    step = 1  # one step's inputs
    result = 2
    stop = 3
    memory = 5  # asks each worker for its device's memory figures (answered on the control pipe)


class InputFlags(enum.IntFlag):
    """Flags of a step frame."""

    NONE = 0
    SAMPLE = 1  # some row needs the sampler (logit_bias, a penalty, a grammar, temperature): a sampled variant runs
    LOGPROBS = 2  # some row asks for logprobs: the step computes them and the result carries them
    PADDED = 4  # a step with prompt tokens padded to its token bucket (num_tokens) and every row of the layout
    PROMPT_LOGPROBS = 8  # the layout carries prompt positions whose logprobs the step computes (eagerly)
    ARGMAX = 16  # with SAMPLE: no row draws (temperature 0 everywhere): the processed logits' argmax, no draw
    UNCUT = 32  # with SAMPLE and not ARGMAX: no row has a cut (top-k, top-p, min_p): the draw sorts nothing


class ResultFlags(enum.IntFlag):
    """Flags of a result frame."""

    NONE = 0
    GRAPH = 1  # the step replayed a captured graph
    DECODE = 2  # a decode step (else one holding prefill tokens)
    LOGPROBS = 4  # the payload carries each row's logprobs after its tokens
    PROMPT_LOGPROBS = 8  # then the logprobs of num_tokens prompt positions


def field_names(kind: FrameKind) -> tuple[str, ...]:
    if kind is FrameKind.step:
        return STEP_FIELD_NAMES
    raise TransportError(f"a {kind.name} frame carries no step inputs")


MAGIC = 0x434F524C  # "CORL"
VERSION = 12  # 12: the checksum after the layout words (one CRC call over the bytes before it); 11: the rows whose
# penalty counts are rebuilt (a count, a row field); 10: prompt logprobs (an input field, the result's positions);
# 9: min_p, min_tokens and the logit-bias and stop-id tables, a sampled token's rank;
# 8: steps padded to a token bucket; 7: the rows' prompt lengths (penalties), the penalties' columns;
# 6: one step kind, tokens, query length, copies; 5: no free float; 4: CRC-32C; 3: named input fields
HEADER_BYTES = 1024  # the payload starts here, 64-byte aligned
MAX_LAYOUT_WORDS = 96
# The fixed fields, then ``words`` int64 layout words, then the CRC-32C of everything before it (and of the
# payload, where the ring checks payloads): one pass over contiguous bytes at each end.
_FIXED = struct.Struct("<IHHQqiiiiiiiiidQI")
_CHECKSUM = struct.Struct("<I")
_FIXED_BYTES, _CHECKSUM_BYTES = _FIXED.size, _CHECKSUM.size
_WORD_STRUCTS = [struct.Struct(f"<{n}q") for n in range(MAX_LAYOUT_WORDS + 1)]
MAX_CACHED_LAYOUTS = 64  # a bound on each cache below, should a producer send many token counts
# Layout words as a consumer decoded them, by their bytes, and as a producer packed them, by the tuple's identity
# (an input frame's words are its ArenaLayout's own tuple): a decode step's layout never changes and a step of
# prefill tokens has one of a few, so neither end packs or unpacks them per frame.
_WORDS_OF: dict[bytes, tuple[int, ...]] = {}
_BYTES_OF: dict[int, tuple[tuple[int, ...], bytes]] = {}
_LAYOUTS: dict[tuple[FrameKind, int, int], tuple[tuple[int, ...], ArenaLayout]] = {}  # by kind, prompt, id(words)


def frame_crc(header: memoryview | bytes, header_bytes: int, payload: memoryview | bytes | None = None) -> int:
    """CRC-32C of a packed header of ``header_bytes`` (up to its checksum, which ends it), followed by the payload
    when one is given.

    The header holds the payload's length, so a header-only CRC still refuses a truncated frame."""
    crc: int = crc32c.crc32c(header[: header_bytes - _CHECKSUM_BYTES])
    return crc if payload is None else crc32c.crc32c(payload, crc)


def _words_bytes(words: Sequence[int]) -> bytes:
    """Layout words not packed before (``FrameHeader._pack_body`` looks them up in ``_BYTES_OF`` first), packed;
    a tuple's are kept there."""
    if len(words) > MAX_LAYOUT_WORDS:
        raise TransportError(f"frame layout has {len(words)} words; at most {MAX_LAYOUT_WORDS} fit")
    packed = _WORD_STRUCTS[len(words)].pack(*words)
    if not isinstance(words, tuple):
        return packed
    if len(_BYTES_OF) >= MAX_CACHED_LAYOUTS:
        _BYTES_OF.clear()
    _BYTES_OF[id(words)] = (words, packed)  # the entry holds the tuple: its id is not reused while cached
    return packed


def _words_of(raw: bytes) -> tuple[int, ...]:
    words = _WORDS_OF.get(raw)
    if words is None:
        words = _WORD_STRUCTS[len(raw) // 8].unpack(raw)
        if len(_WORDS_OF) >= MAX_CACHED_LAYOUTS:
            _WORDS_OF.clear()
        _WORDS_OF[raw] = words
    return words


@dataclass(slots=True)
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
    layout: Sequence[int] = ()  # the arena layout's words (ArenaLayout.words)
    num_tokens: int = 0  # step frames: tokens computed
    max_query_len: int = 0  # step frames: the most tokens one row feeds
    num_copies: int = 0  # step frames: KV blocks copied before the forward
    decode_rows: int = 0  # step frames: the leading rows that feed one token each
    num_recounts: int = 0  # step frames: rows whose penalty counts are rebuilt before the forward

    @property
    def nbytes(self) -> int:
        return _FIXED_BYTES + 8 * len(self.layout) + _CHECKSUM_BYTES

    def _pack_body(self, buffer: memoryview | bytearray) -> int:
        """Everything but the checksum into ``buffer``; returns the checksum's offset."""
        layout = self.layout
        found = _BYTES_OF.get(id(layout))  # a step's layout packed before, by its tuple's identity
        words = found[1] if found is not None and found[0] is layout else _words_bytes(layout)
        # kind and flags are int subclasses (IntEnum, IntFlag) or ints: struct packs them as they are
        _FIXED.pack_into(buffer, 0, MAGIC, VERSION, self.kind, self.seq, self.step_id, self.num_seqs, self.bucket,
                         self.kv_blocks, self.num_tokens, self.max_query_len, self.num_copies, self.decode_rows,
                         self.num_recounts, self.flags, self.sent_at, self.payload_len, len(layout))
        end = _FIXED_BYTES + len(words)
        buffer[_FIXED_BYTES:end] = words
        return end

    def packed(self, checksum: int | None = None) -> bytes:
        buffer = bytearray(self.nbytes)
        at = self._pack_body(buffer)
        _CHECKSUM.pack_into(buffer, at, self.checksum if checksum is None else checksum)
        return bytes(buffer)

    def pack_into(self, buffer: memoryview) -> None:
        """Write the packed header at the start of ``buffer`` (a slot's header area)."""
        _CHECKSUM.pack_into(buffer, self._pack_body(buffer), self.checksum)

    def seal_into(self, buffer: memoryview, payload: memoryview | None = None) -> None:
        """Pack the header into ``buffer`` (a slot's header area) with its CRC-32C, taken over the packed bytes
        (and ``payload`` when given): the header is packed once."""
        at = self._pack_body(buffer)
        crc: int = crc32c.crc32c(buffer[:at])  # frame_crc's, written out: this runs on every step's hop
        self.checksum = crc if payload is None else crc32c.crc32c(payload, crc)
        _CHECKSUM.pack_into(buffer, at, self.checksum)

    def crc(self, payload: memoryview | bytes | None = None) -> int:
        """CRC-32C of the header (up to its checksum), followed by the payload when one is given."""
        return frame_crc(self.packed(0), self.nbytes, payload)

    @classmethod
    def unpack_from(cls, buffer: memoryview, where: str | None = None) -> FrameHeader:
        """The header packed at the start of ``buffer``; a TransportError says what is wrong, after ``where``
        (a caller on the hop leaves it out and adds it to the message: it is built only for a bad frame)."""
        header = sound_header(buffer)
        if header is None:
            fields = _FIXED.unpack_from(buffer, 0)
            raise TransportError(_located(where, _malformed(fields[0], fields[1], fields[2], fields[-1])))
        return header

    def input_layout(self, where: str | None = None) -> ArenaLayout:
        """The arena layout of an input frame; a TransportError names the frame when it is malformed.

        Decoded once per distinct layout: a decode step's layout never changes and a step of
        prefill tokens has one of a few token counts, so a worker looks it up rather than
        rebuilding it every step.
        """
        prompt = 1 if self.flags & _PROMPT_LOGPROBS and self.kind is FrameKind.step else 0
        words = self.layout
        key = (self.kind, prompt, id(words))
        found = _LAYOUTS.get(key)
        if found is not None and found[0] is words:
            layout = found[1]
        else:
            names = field_names(self.kind)
            if prompt:
                names = (*names, PROMPT_LOGPROBS)
            if words and words[0] == len(names) + 1:  # a step that carries the token bitmask
                names = (*names, TOKEN_MASK)
            try:
                layout = ArenaLayout.decode(names, words)
            except ValueError as error:
                raise TransportError(_located(where, str(error))) from None
            if isinstance(words, tuple):  # immutable: cached by identity (the entry keeps it alive)
                if len(_LAYOUTS) >= MAX_CACHED_LAYOUTS:
                    _LAYOUTS.clear()
                _LAYOUTS[key] = (words, layout)
        if layout.nbytes > self.payload_len:
            raise TransportError(_located(where, f"payload of {self.payload_len} bytes is shorter than its layout "
                                                f"({layout.nbytes} bytes)"))
        return layout


_KINDS = {int(kind): kind for kind in FrameKind}


def sound_header(buffer: memoryview, seq: int | None = None, capacity: int = 0) -> FrameHeader | None:
    """The header packed at the start of ``buffer``, or None where its magic, version, kind or layout length is off.
    With ``seq``, also None unless it passes every other check of the header alone: it is frame ``seq``'s, its
    payload length within ``capacity``, its CRC-32C sound. The caller asks :meth:`FrameHeader.unpack_from` and
    :func:`frame_crc` what is wrong. The check every frame passes on the hop: one call, one unpack and one CRC, no
    message built."""
    (magic, version, kind, frame_seq, step_id, num_seqs, bucket, kv_blocks, num_tokens, max_query_len, num_copies,
     decode_rows, num_recounts, flags, sent_at, payload_len, words) = _FIXED.unpack_from(buffer, 0)
    frame_kind = _KINDS.get(kind)
    if magic != MAGIC or version != VERSION or frame_kind is None or words > MAX_LAYOUT_WORDS:
        return None
    end = _FIXED_BYTES + 8 * words
    (checksum,) = _CHECKSUM.unpack_from(buffer, end)
    if seq is not None and (frame_seq != seq or payload_len > capacity or crc32c.crc32c(buffer[:end]) != checksum):
        return None
    if words:
        raw = bytes(buffer[_FIXED_BYTES:end])
        layout = _WORDS_OF.get(raw) or _words_of(raw)
    else:
        layout = ()
    return FrameHeader(frame_kind, frame_seq, step_id, num_seqs, bucket, kv_blocks, flags, sent_at, payload_len,
                       checksum, layout, num_tokens, max_query_len, num_copies, decode_rows, num_recounts)


def _located(where: str | None, message: str) -> str:
    return message if where is None else f"{where}: {message}"


def _malformed(magic: int, version: int, kind: int, words: int) -> str:
    """What is wrong with a header's fixed fields (one of them is)."""
    if magic != MAGIC:
        return f"bad magic 0x{magic:08x} (not a corelib frame, or overwritten)"
    if version != VERSION:
        return f"frame version {version}, this corelib speaks version {VERSION}"
    if kind not in _KINDS:
        return f"unknown frame kind {kind}"
    return f"layout of {words} words is longer than {MAX_LAYOUT_WORDS}"


def input_header(fi: ForwardInput, sent_at: float) -> FrameHeader:
    """The header of the input frame that carries step ``fi`` (its arena is the payload)."""
    # Plain integers: an IntFlag's ``|`` costs microseconds, on the path of every step.
    flags = (_SAMPLE if fi.sample else 0) | (_LOGPROBS if fi.logprobs else 0) | (_PADDED if fi.padded else 0) | (
        _PROMPT_LOGPROBS if fi.prompt_logprobs else 0) | (0 if fi.draws else _ARGMAX) | (0 if fi.cuts else _UNCUT)
    return FrameHeader(FrameKind.step, 0, fi.step_id, fi.num_seqs, fi.bucket, fi.kv_blocks, flags, sent_at, 0, 0,
                       fi.layout.words, fi.num_tokens, fi.max_query_len, fi.num_copies, fi.decode_rows, fi.num_recounts)


def input_of(header: FrameHeader, payload: torch.Tensor, where: str | None = None) -> ForwardInput:
    """The step a checked step frame describes; its arena views ``payload``. A TransportError says what is
    malformed, after ``where`` when given."""
    layout = header.input_layout(where)
    rows, bucket, tokens, longest = header.num_seqs, header.bucket, header.num_tokens, header.max_query_len
    copies, decode_rows, recounts, flags = header.num_copies, header.decode_rows, header.num_recounts, header.flags
    if (not 1 <= longest <= (tokens if tokens > 1 else 1) or bucket < rows or not 0 <= copies <= rows
            or not 0 <= decode_rows < (bucket if bucket > 1 else 1) or not 0 <= recounts <= rows):
        raise TransportError(_located(where, f"a step of {rows} rows ({bucket} computed), {tokens} tokens and up "
                                             f"to {longest} per row is malformed"))
    prompt = layout.fields[layout.names.index(PROMPT_LOGPROBS)].shape[1] if flags & _PROMPT_LOGPROBS else 0
    return ForwardInput(header.step_id, rows, bucket, tokens, longest, header.kv_blocks, flags & _SAMPLE != 0, layout,
                        payload, flags & _LOGPROBS != 0, copies, decode_rows, flags & _PADDED != 0, prompt, recounts,
                        draws=flags & _ARGMAX == 0, cuts=flags & _UNCUT == 0)


_SAMPLE, _LOGPROBS, _PADDED, _PROMPT_LOGPROBS, _ARGMAX, _UNCUT = (int(flag) for flag in (
    InputFlags.SAMPLE, InputFlags.LOGPROBS, InputFlags.PADDED, InputFlags.PROMPT_LOGPROBS, InputFlags.ARGMAX,
    InputFlags.UNCUT))


# ---------------------------------------------------------------------------------------- results
RESULT_TAIL = struct.Struct("<dddd")  # busy ms, gap ms (-1: none), transport µs, its wake-up part µs (-1: none)


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
    logprobs: list[list[float]] | None = None  # per row, LOGPROB_WIDTH floats
    prompt_logprobs: list[list[float]] | None = None  # per prompt position the step computed, LOGPROB_WIDTH floats
    wake_us: float | None = None  # of transport_us, the part until the frame was in the worker's hands

    def step_result(self) -> StepResult:
        """The step's result as the engine takes it."""
        kind = StepKind.decode if self.decode else StepKind.prefill
        return StepResult(self.step_id, kind, self.tokens, self.busy_ms, self.gap_ms, self.graph, self.transport_us,
                          logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs, wake_us=self.wake_us)


def result_bytes(max_rows: int, max_prompt_positions: int = 0) -> int:
    """The largest result payload: a token and a logprob row per row, and a logprob row per prompt position."""
    return 8 * max_rows + RESULT_TAIL.size + 4 * LOGPROB_WIDTH * (max_rows + max_prompt_positions)


def result_header(result: WireResult, sent_at: float) -> FrameHeader:
    flags = (ResultFlags.GRAPH if result.graph else ResultFlags.NONE) | (
        ResultFlags.DECODE if result.decode else ResultFlags.NONE) | (
        ResultFlags.LOGPROBS if result.logprobs is not None else ResultFlags.NONE) | (
        ResultFlags.PROMPT_LOGPROBS if result.prompt_logprobs is not None else ResultFlags.NONE)
    prompt = 0 if result.prompt_logprobs is None else len(result.prompt_logprobs)
    return FrameHeader(FrameKind.result, 0, result.step_id, len(result.tokens), flags=int(flags), sent_at=sent_at,
                       num_tokens=prompt)


def encode_result(result: WireResult) -> bytes:
    tokens = struct.pack(f"<{len(result.tokens)}q", *result.tokens)
    gap = -1.0 if result.gap_ms is None else result.gap_ms
    wake = -1.0 if result.wake_us is None else result.wake_us
    tail = RESULT_TAIL.pack(result.busy_ms or 0.0, gap, result.transport_us, wake)
    parts = [tokens, tail]
    for rows in (result.logprobs, result.prompt_logprobs):
        if rows is not None:
            flat = [value for row in rows for value in row]
            parts.append(struct.pack(f"<{len(flat)}f", *flat))
    return b"".join(parts)


def decode_result(header: FrameHeader, payload: bytes | memoryview) -> WireResult:
    n = header.num_seqs
    if len(payload) < 8 * n + RESULT_TAIL.size:
        raise TransportError(f"result frame for step {header.step_id}: {len(payload)} bytes cannot hold {n} tokens")
    tokens = list(struct.unpack_from(f"<{n}q", payload, 0))
    busy, gap, transport, wake = RESULT_TAIL.unpack_from(payload, 8 * n)
    flags = ResultFlags(header.flags)
    at = 8 * n + RESULT_TAIL.size
    logprobs = prompt_logprobs = None
    if ResultFlags.LOGPROBS in flags:
        logprobs = _logprob_rows(header, payload, at, n, "its rows' logprobs")
        at += 4 * LOGPROB_WIDTH * n
    if ResultFlags.PROMPT_LOGPROBS in flags:
        prompt_logprobs = _logprob_rows(header, payload, at, header.num_tokens, "its prompt logprobs")
    return WireResult(header.step_id, ResultFlags.DECODE in flags, ResultFlags.GRAPH in flags, tokens,
                      busy or None, None if gap < 0 else gap, transport, logprobs, prompt_logprobs,
                      None if wake < 0 else wake)


def _logprob_rows(header: FrameHeader, payload: bytes | memoryview, at: int, count: int,
                  what: str) -> list[list[float]]:
    if count < 0 or len(payload) < at + 4 * LOGPROB_WIDTH * count:
        raise TransportError(f"result frame for step {header.step_id}: too short for {what}")
    flat = struct.unpack_from(f"<{LOGPROB_WIDTH * count}f", payload, at)
    return [list(flat[i * LOGPROB_WIDTH : (i + 1) * LOGPROB_WIDTH]) for i in range(count)]
