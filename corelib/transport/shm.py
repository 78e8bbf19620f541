"""A POSIX shared-memory ring of frames between one producer and N consumers.

A segment holds a control block, then the frame slots. The control block keeps one 8-byte
counter per 64-byte cache line, each with a single writer:

- ``COMMITTED`` (producer): frames committed so far; frame ``n`` lives in slot ``n % num_slots``;
- ``ALWAYS`` (any end, at attach): 1 when some process lacks the waiters' barrier, so
  publishers ring on every publication (see :mod:`corelib.transport.doorbell`);
- ``PRODUCER_ASLEEP`` (producer), and per consumer ``RELEASED[i]`` (frames it gave back, in
  order) and ``ASLEEP[i]``.

A slot is written again only after every consumer released the frame in it (back-pressure).
Each frame: a fixed header (magic, version, kind, sequence number, step fields, send time,
payload length, the arena layout, then a CRC-32C of them) and an aligned payload arena. The CRC covers the
header, the payload's length with it: a flipped step field, layout word or length would
otherwise reach the model unnoticed. With ``payload_crc`` (``engine.shm.payload_crc``, for
chaos and fault runs) it covers the payload too; without it the payload is never read on the
hop, so a step costs no pass over its bytes but the packer's writes.

A producer may hand out the next slot's payload itself (:meth:`Producer.reserve`) for the
packer to write in place, then publish it (:meth:`Producer.commit`): the slot is the step's
arena, and nothing copies it. A consumer may likewise read a frame in place for as long as it
holds it, releasing it once nothing reads it any more (a step's device work done).

Memory ordering. The producer writes the payload, then the header, then stores ``COMMITTED``;
a consumer loads ``COMMITTED``, then reads the header and payload. A consumer finishes reading
a slot, then stores ``RELEASED``; the producer loads it before it writes that slot again.
Counters are 8-byte aligned in the mapping and read and written through a ``memoryview``
cast to ``Q``, one 8-byte load or store each (single-copy atomic on x86-64 and aarch64).

- x86-64 (TSO): stores become visible in program order and loads are not reordered with older
  loads or with later stores, so a consumer that sees ``COMMITTED = n`` sees frame ``n - 1``
  whole, and a producer that sees a release sees a slot no longer read.
- Weakly ordered CPUs (aarch64, POWER): Python has no fence instruction, so every counter
  store that publishes (a commit, a release) follows ``membarrier(2)``, which runs a full
  barrier in the calling thread (:func:`corelib.transport.doorbell.publish_fence`); the ring
  refuses to start without it there. A consumer may still load a frame's bytes before its
  ``COMMITTED``: it checks the CRC (over the header, and the payload where ``payload_crc``)
  and re-reads for :data:`SETTLE_S` before it calls the frame corrupt. Its reads of the
  payload come later still (the stager's, the model's), after the header's checks and a lock
  or a system call on the way.

The segments themselves (reservation, lease, sweep, cleanup at exit) are
:mod:`corelib.transport.segment`.

Long: the producer and the consumers rest on one memory-ordering argument (above) and one slot
protocol (reserve, commit, read in place, release in order); split, each half would restate them.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from corelib.errors import TransportError
from corelib.transport import doorbell
from corelib.transport.doorbell import Bell, Waiter
from corelib.transport.segment import PREFIX, SHM_DIR, Segment, segment_name, sweep_stale
from corelib.transport.wire import HEADER_BYTES, FrameHeader, frame_crc, sound_header

__all__ = ["PREFIX", "SHM_DIR", "Consumer", "Frame", "Producer", "Ring", "Segment", "segment_name", "sweep_stale"]

SETTLE_S = 0.005  # how long a frame that fails its checks is re-read before it is called corrupt

_LINE = 8  # 8-byte words per 64-byte cache line
_MAX_FRAME_VIEWS = 256  # cached payload views per ring: (slot, length) pairs
COMMITTED, ALWAYS, PRODUCER_ASLEEP = (i * _LINE for i in range(3))


def released_word(consumer: int) -> int:
    return (3 + 2 * consumer) * _LINE


def asleep_word(consumer: int) -> int:
    return (4 + 2 * consumer) * _LINE


def control_bytes(num_consumers: int) -> int:
    """The control block, whole pages, so the slots that follow stay page-aligned (host registration)."""
    return -(-64 * (3 + 2 * num_consumers) // mmap.PAGESIZE) * mmap.PAGESIZE


@dataclass
class Frame:
    header: FrameHeader
    slot: int
    payload: torch.Tensor  # uint8 view into the segment, header.payload_len bytes
    data: memoryview  # the same bytes


class Ring:
    """The control block and frame slots of one segment; shared by the producer and consumer endpoints."""

    def __init__(self, segment: Segment, num_slots: int, slot_bytes: int, num_consumers: int) -> None:
        if slot_bytes <= HEADER_BYTES or slot_bytes % 64:
            raise TransportError(
                f"engine.shm.slot_bytes={slot_bytes}: must exceed {HEADER_BYTES} and be a multiple of 64"
            )
        self.segment = segment
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.num_consumers = num_consumers
        self.capacity = slot_bytes - HEADER_BYTES
        self.base = control_bytes(num_consumers)
        try:
            barrier = doorbell.register()
        except TransportError:
            segment.close()
            raise
        self.words = segment.view[: self.base].cast("Q")
        if not barrier:
            self.words[ALWAYS] = 1  # no waiters' barrier in this process: publishers ring every time
        # One tensor over all slots, slots as views of it: registering ``whole`` pins them all.
        self.whole = segment.tensor(self.base, num_slots * slot_bytes)
        self._payloads = [self.whole[i * slot_bytes + HEADER_BYTES : (i + 1) * slot_bytes] for i in range(num_slots)]
        self._headers = [segment.view[self.base + i * slot_bytes : self.base + i * slot_bytes + HEADER_BYTES]
                         for i in range(num_slots)]
        # A frame's payload views by slot and length, made once each: a decode step's length never changes.
        self._frame_views: dict[tuple[int, int], tuple[torch.Tensor, memoryview]] = {}
        self._closed = False

    @staticmethod
    def size(num_slots: int, slot_bytes: int, num_consumers: int) -> int:
        return control_bytes(num_consumers) + num_slots * slot_bytes

    @classmethod
    def create(cls, role: str, num_slots: int, slot_bytes: int, num_consumers: int = 1) -> Ring:
        size = cls.size(num_slots, slot_bytes, num_consumers)
        for attempt in range(3):  # a sweep in another PID namespace may take a name being created
            try:
                return cls(Segment(segment_name(role), size, create=True), num_slots, slot_bytes, num_consumers)
            except TransportError as error:
                if "removed by a sweep" not in str(error) or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    @classmethod
    def attach(cls, name: str, num_slots: int, slot_bytes: int, num_consumers: int = 1) -> Ring:
        size = cls.size(num_slots, slot_bytes, num_consumers)
        return cls(Segment(name, size, create=False), num_slots, slot_bytes, num_consumers)

    def slot_offset(self, slot: int) -> int:
        return self.base + slot * self.slot_bytes

    def header_view(self, slot: int) -> memoryview:
        return self._headers[slot]

    def payload(self, slot: int) -> torch.Tensor:
        return self._payloads[slot]

    def frame_views(self, slot: int, nbytes: int) -> tuple[torch.Tensor, memoryview]:
        """The first ``nbytes`` of ``slot``'s payload, as a uint8 tensor and as a memoryview (cached)."""
        found = self._frame_views.get((slot, nbytes))
        if found is None:
            if len(self._frame_views) >= _MAX_FRAME_VIEWS:
                self._drop_frame_views()
            start = self.slot_offset(slot) + HEADER_BYTES
            found = (self._payloads[slot][:nbytes], self.segment.view[start : start + nbytes])
            self._frame_views[(slot, nbytes)] = found
        return found

    def _drop_frame_views(self) -> None:
        views, self._frame_views = self._frame_views, {}
        for _, data in views.values():
            data.release()

    def close(self) -> None:
        """Drop the views, unmap, and (owner) unlink. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._drop_frame_views()
        for header in self._headers:
            header.release()
        self._headers.clear()
        self._payloads.clear()
        self.words.release()
        del self.whole
        self.segment.close()


def as_bytes(payload: torch.Tensor | bytes | memoryview) -> memoryview:
    if isinstance(payload, torch.Tensor):
        return payload.numpy().data  # a host uint8 tensor: the copy below is one memcpy
    return memoryview(payload)


class Producer:
    """Writes frames; waits (bounded) while the next slot still holds a frame some consumer did not release."""

    def __init__(
        self,
        ring: Ring,
        bells: Sequence[int],
        room: int,
        timeout_s: float,
        alive: Callable[[], str | None] = lambda: None,
        name: str = "ring",
        consumer_names: Sequence[str] | None = None,
        spin_us: float = 0.0,
        watch: Sequence[int] = (),
        payload_crc: bool = False,
    ) -> None:
        if len(bells) != ring.num_consumers:
            raise ValueError(f"{name}: {len(bells)} doorbells for {ring.num_consumers} consumers")
        self.ring = ring
        self._words = ring.words
        self._consumer_names = list(consumer_names or [f"consumer {i}" for i in range(len(bells))])
        self._bells = [Bell(fd, ring.words, asleep_word(i), ALWAYS) for i, fd in enumerate(bells)]
        self._released = [released_word(i) for i in range(len(bells))]
        self._room = Waiter(room, ring.words, PRODUCER_ASLEEP, spin_us, alive, watch, f"a consumer of {name}")
        self._timeout = timeout_s
        self._name = name
        self._next_seq = 0
        self._payload_crc = payload_crc
        self._reserved = False  # the next frame's slot was handed out by reserve() and not committed yet
        # Test hook: called with the payload after the checksum, before the commit.
        self.tamper: Callable[[FrameHeader, torch.Tensor], None] | None = None

    @property
    def sent(self) -> int:
        return self._next_seq

    def _has_room(self, frame: int) -> bool:
        """Every consumer released ``frame`` (the previous occupant of the slot about to be written)."""
        words = self._words
        return all(words[word] > frame for word in self._released)

    def has_room(self) -> bool:
        """The next frame can be written without waiting."""
        previous = self._next_seq - self.ring.num_slots
        return previous < 0 or self._has_room(previous)

    def _wait_for_room(self, seq: int) -> None:
        previous = seq - self.ring.num_slots
        if previous < 0 or self._room.wait(lambda: self._has_room(previous), self._timeout):
            return
        behind = next(i for i, word in enumerate(self._released) if self._words[word] <= previous)
        raise TransportError(f"waited {self._timeout:g} s for {self._consumer_names[behind]} to release slot "
                             f"{previous % self.ring.num_slots} of {self._name} (frame {previous}); "
                             f"{self._released_so_far()}")

    def reserve(self) -> torch.Tensor:
        """The payload of the next frame's slot, to be written in place, once every consumer released it
        (bounded wait). Until :meth:`commit` it stays the next frame's: reserving again hands out the same
        slot, as does a write."""
        seq = self._next_seq
        if not self._reserved:
            self._wait_for_room(seq)
            self._reserved = True
        return self.ring.payload(seq % self.ring.num_slots)

    def is_reserved(self, payload: torch.Tensor) -> bool:
        """``payload`` starts the reserved slot's payload (it was written in place)."""
        slot = self.ring.payload(self._next_seq % self.ring.num_slots)
        return self._reserved and payload.data_ptr() == slot.data_ptr()

    def write(self, header: FrameHeader, payload: torch.Tensor | bytes | memoryview | None = None) -> int:
        """Write one frame (payload copied into the slot); returns its sequence number."""
        seq = self._next_seq
        ring = self.ring
        slot = seq % ring.num_slots
        if not self._reserved:
            self._wait_for_room(seq)
        nbytes = 0
        if payload is not None:
            data = as_bytes(payload)
            nbytes = data.nbytes
            if nbytes > ring.capacity:
                raise TransportError(
                    f"{self._name}: a frame of {nbytes} bytes does not fit a slot of {ring.capacity}; "
                    "raise engine.shm.slot_bytes"
                )
            start = ring.slot_offset(slot) + HEADER_BYTES
            ring.segment.view[start : start + nbytes] = data.cast("B")
        self._reserved = True
        return self.commit(header, nbytes)

    def commit(self, header: FrameHeader, nbytes: int) -> int:
        """Publish the reserved slot as a frame of ``nbytes`` payload bytes (written in place); returns its
        sequence number."""
        if not self._reserved:
            raise RuntimeError(f"{self._name}: commit without a reserved slot")
        ring = self.ring
        if nbytes > ring.capacity:
            raise TransportError(f"{self._name}: a frame of {nbytes} bytes does not fit a slot of {ring.capacity}; "
                                 "raise engine.shm.slot_bytes")
        seq = self._next_seq
        slot = seq % ring.num_slots
        header.seq = seq
        header.payload_len = nbytes
        payload = ring.frame_views(slot, nbytes)[1] if self._payload_crc else None
        if self.tamper is None:
            header.seal_into(ring.header_view(slot), payload)
        else:
            header.checksum = header.crc(payload)
            self.tamper(header, ring.payload(slot)[:nbytes])
            header.pack_into(ring.header_view(slot))
        doorbell.publish_fence()
        self._words[COMMITTED] = seq + 1
        self._next_seq = seq + 1
        self._reserved = False
        self.nudge()  # the consumers that sleep wake to the frame just published
        return seq

    def nudge(self) -> None:
        """Ring every consumer asleep on its doorbell (a system call each, none where all spin). Without a frame
        published, a heads-up: a frame follows soon, and a consumer woken so spins until it comes."""
        for bell in self._bells:
            bell.ring()

    def progress(self) -> str:
        """How far each consumer got: the one that stalls shows behind the others."""
        return self._released_so_far()

    def _released_so_far(self) -> str:
        return "frames released: " + ", ".join(
            f"{name}: {self._words[word]}" for name, word in zip(self._consumer_names, self._released, strict=True)
        ) + f" of {self._next_seq} sent"


class Consumer:
    """Reads frames in order and validates them; releases slots back to the producer."""

    def __init__(
        self,
        ring: Ring,
        index: int,
        bell: int,
        room: int,
        timeout_s: float,
        alive: Callable[[], str | None] = lambda: None,
        name: str = "ring",
        spin_us: float = 0.0,
        watch: Sequence[int] = (),
        payload_crc: bool = False,
    ) -> None:
        self.ring = ring
        self._words = ring.words
        self._payload_crc = payload_crc
        self._releasing = threading.Lock()  # frames are released by the thread whose step stopped reading them
        self._waiter = Waiter(bell, ring.words, asleep_word(index), spin_us, alive, watch, f"the producer of {name}")
        self._room = Bell(room, ring.words, PRODUCER_ASLEEP, ALWAYS)
        self._released_word = released_word(index)
        self._timeout = timeout_s
        self._name = name
        self._expected = 0
        self._released = 0
        self._early: set[int] = set()  # frames released ahead of an older one still held

    @property
    def expected(self) -> int:
        """The sequence number of the next frame to read."""
        return self._expected

    @property
    def sleeps(self) -> int:
        return self._waiter.sleeps

    def available(self) -> bool:
        return self._words[COMMITTED] > self._expected

    def wait(self, timeout: float, also: Callable[[], bool] | None = None) -> bool:
        """Until a frame is there (True) or ``also()`` holds (False); TransportError after ``timeout``."""
        words, expected = self._words, self._expected

        def ready() -> bool:  # the frame looked for again after ``also()``, a device query that may take a while
            return words[COMMITTED] > expected or (also is not None and (also() or words[COMMITTED] > expected))

        if not self._waiter.wait(ready, timeout):
            raise TransportError(f"waited {timeout:g} s on {self._name}")
        return words[COMMITTED] > expected

    def read(self, timeout: float | None = None, who: str = "the next frame") -> Frame:
        """The next frame; raises TransportError naming the frame when it is corrupt."""
        timeout = self._timeout if timeout is None else timeout
        if not self.available():
            words, expected = self._words, self._expected
            if not self._waiter.wait(lambda: words[COMMITTED] > expected, timeout):
                raise TransportError(f"waited {timeout:g} s for {who} on {self._name}")
        ring = self.ring
        seq = self._expected
        slot = seq % ring.num_slots
        # Every frame's check in one call; a frame that fails it (or one whose payload is checked too) is checked
        # again piece by piece, which names what is wrong, and re-read while it may still be arriving.
        header = None if self._payload_crc else sound_header(ring.header_view(slot), seq, ring.capacity)
        if header is None:
            try:
                header = self._checked(seq, slot)
            except TransportError:
                header = self._settled(seq, slot)
        self._expected = seq + 1
        payload, data = ring.frame_views(slot, header.payload_len)
        return Frame(header, slot, payload, data)

    def where(self, seq: int, slot: int) -> str:
        """How an error names frame ``seq``: built only for a bad frame, not on every step's hop."""
        return f"{self._name} frame {seq} (slot {slot})"

    def _settled(self, seq: int, slot: int) -> FrameHeader:
        """Re-read a frame that failed its checks until it passes or :data:`SETTLE_S` is over (then raise)."""
        settle = time.monotonic() + SETTLE_S
        while True:
            os.sched_yield()  # the producer's writes may still be on their way to this CPU
            try:
                return self._checked(seq, slot)
            except TransportError:
                if time.monotonic() >= settle:
                    raise

    def _checked(self, seq: int, slot: int) -> FrameHeader:
        ring = self.ring
        header_view = ring.header_view(slot)
        try:
            header = FrameHeader.unpack_from(header_view)
        except TransportError as error:
            raise TransportError(f"{self.where(seq, slot)}: {error}") from None
        if header.seq != seq:
            raise TransportError(f"{self.where(seq, slot)}: the header says frame {header.seq} (overwritten before "
                                 "it was read)")
        if header.payload_len > ring.capacity:
            raise TransportError(f"{self.where(seq, slot)}: payload length {header.payload_len} exceeds the slot's "
                                 f"{ring.capacity}")
        payload = ring.frame_views(slot, header.payload_len)[1] if self._payload_crc else None
        crc = frame_crc(header_view, header.nbytes, payload)
        if crc != header.checksum:
            raise TransportError(
                f"{self.where(seq, slot)}: bad checksum (header says 0x{header.checksum:08x}, frame is 0x{crc:08x}); "
                "the frame was corrupted or truncated"
            )
        return header

    def release(self, frame: Frame) -> None:
        """Give the slot back: the producer may overwrite it from now on (once every older frame is back too)."""
        seq = frame.header.seq
        with self._releasing:
            if seq != self._released:
                self._early.add(seq)
                return
            released = seq + 1
            while released in self._early:
                self._early.remove(released)
                released += 1
            self._released = released
            doorbell.publish_fence()  # the slot's reads are done before the producer may see it free
            self._words[self._released_word] = released
        self._room.ring()

