"""A POSIX shared-memory ring of frames between one producer and N consumers.

Data travels through the shared segment; control travels through pipes. A producer rings
each consumer's doorbell after it wrote a frame, and a consumer sends the slot back on its
release pipe once it no longer reads it. Both are system calls, which order the memory
accesses around them on every CPU architecture, so the ring needs no atomics. A slot is
written again only after every consumer has released the frame in it (back-pressure).

Each frame: a fixed header (magic, version, kind, sequence number, step fields, send time,
payload length, a CRC-32, the arena layout) and an aligned payload arena. The CRC covers the
header as well as the payload: a flipped step field or layout word would otherwise reach the
model unnoticed.
Segments are created owner-only (0600) under unique names and unlinked on close; a segment
left by a process that no longer exists is found and removed by :func:`sweep_stale`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

from corelib.engine.wire import HEADER_BYTES, FrameHeader
from corelib.errors import TransportError, WorkerDied

SHM_DIR = Path("/dev/shm")
PREFIX = "corelib"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+-\w+$")


def segment_name(role: str) -> str:
    """Unique per engine: the owner's pid (for stale detection), random bits, and a role."""
    return f"{PREFIX}-{os.getpid()}-{secrets.token_hex(4)}-{role}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Unlink this user's corelib segments whose creating process is gone; returns their names."""
    removed: list[str] = []
    if not SHM_DIR.is_dir():
        return removed
    for path in SHM_DIR.iterdir():
        match = _NAME.match(path.name)
        if not match or _pid_alive(int(match.group(1))):
            continue
        try:
            if path.stat().st_uid != os.getuid():
                continue
            path.unlink()
            removed.append(path.name)
        except OSError:
            continue
    return removed


class Segment:
    """A named POSIX shared-memory segment mapped into this process."""

    def __init__(self, name: str, size: int, create: bool) -> None:
        self.name = name
        self.size = size
        self.owner = create
        path = SHM_DIR / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as error:
            raise TransportError(f"shared memory segment {name}: {error.strerror}") from error
        try:
            if create:
                os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.view = memoryview(self.map)

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over part of the segment (no copy)."""
        return torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes, offset=offset)

    def close(self) -> None:
        """Unmap; the owner also unlinks. Tensor views must be gone first."""
        try:
            self.view.release()
            self.map.close()
        except BufferError:
            pass  # a tensor still views the mapping; the OS unmaps at exit
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                (SHM_DIR / self.name).unlink()


@dataclass
class Frame:
    header: FrameHeader
    slot: int
    payload: torch.Tensor  # uint8 view into the segment, header.payload_len bytes


class Ring:
    """The frame slots of one segment; shared by the producer and consumer endpoints."""

    def __init__(self, segment: Segment, num_slots: int, slot_bytes: int) -> None:
        if slot_bytes <= HEADER_BYTES or slot_bytes % 64:
            raise TransportError(
                f"engine.shm.slot_bytes={slot_bytes}: must exceed {HEADER_BYTES} and be a multiple of 64"
            )
        self.segment = segment
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.capacity = slot_bytes - HEADER_BYTES
        # One tensor over the whole segment, slots as views of it: registering ``whole`` pins them all.
        self.whole = segment.tensor(0, num_slots * slot_bytes)
        self._payloads = [self.whole[i * slot_bytes + HEADER_BYTES : (i + 1) * slot_bytes] for i in range(num_slots)]
        self._closed = False

    @classmethod
    def create(cls, role: str, num_slots: int, slot_bytes: int) -> Ring:
        return cls(Segment(segment_name(role), num_slots * slot_bytes, create=True), num_slots, slot_bytes)

    @classmethod
    def attach(cls, name: str, num_slots: int, slot_bytes: int) -> Ring:
        return cls(Segment(name, num_slots * slot_bytes, create=False), num_slots, slot_bytes)

    def header_view(self, slot: int) -> memoryview:
        start = slot * self.slot_bytes
        return self.segment.view[start : start + HEADER_BYTES]

    def payload(self, slot: int) -> torch.Tensor:
        return self._payloads[slot]

    def close(self) -> None:
        """Drop the views, unmap, and (owner) unlink. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._payloads.clear()
        del self.whole
        self.segment.close()


def _explain(alive: Callable[[], str | None], fallback: str, grace: float = 2.0) -> str:
    """Why the peer is gone: a closed pipe shows before the exit status, so ask again briefly."""
    deadline = time.monotonic() + grace
    while True:
        reason = alive()
        if reason is not None:
            return reason
        if time.monotonic() >= deadline:
            return fallback
        time.sleep(0.01)


def _wait_readable(conn: Connection, timeout: float, who: str, alive: Callable[[], str | None]) -> None:
    """Wait until ``conn`` has data, checking ``alive`` (None or why the peer is gone) as we go."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportError(f"waited {timeout:g} s for {who}")
        if wait([conn], min(left, 0.25)):
            return
        reason = alive()
        if reason is not None:
            raise WorkerDied(reason)


class Producer:
    """Writes frames; blocks (bounded) while the next slot still holds an unreleased frame."""

    def __init__(
        self,
        ring: Ring,
        doorbells: Sequence[Connection],
        releases: Sequence[Connection],
        timeout_s: float,
        alive: Callable[[], str | None] = lambda: None,
        name: str = "ring",
        consumer_names: Sequence[str] | None = None,
    ) -> None:
        self.ring = ring
        self._consumer_names = list(consumer_names or [f"consumer {i}" for i in range(len(releases))])
        self._doorbells = list(doorbells)
        self._releases = list(releases)
        self._timeout = timeout_s
        self._alive = alive
        self._name = name
        self._next_seq = 0
        # Highest sequence number each consumer released, per slot (-1: never written).
        self._released = [[-1] * ring.num_slots for _ in releases]
        self._written = [-1] * ring.num_slots
        # Test hook: called with the payload after the checksum, before the commit.
        self.tamper: Callable[[FrameHeader, torch.Tensor], None] | None = None

    def _drain_releases(self, block_for: int | None) -> None:
        for index, conn in enumerate(self._releases):
            while True:
                if block_for is not None and self._released[index][block_for] < self._written[block_for]:
                    who = self._consumer_names[index]
                    try:
                        _wait_readable(conn, self._timeout, f"{who} to release slot {block_for} of {self._name} "
                                       f"(frame {self._written[block_for]})", self._alive)
                    except TransportError as error:
                        raise TransportError(f"{error}; {self._released_so_far()}") from None
                elif not conn.poll():
                    break
                try:
                    slot, seq = struct.unpack("<iq", conn.recv_bytes())
                except EOFError:
                    gone = f"{self._consumer_names[index]} closed its end of {self._name}"
                    raise WorkerDied(_explain(self._alive, gone)) from None
                self._released[index][slot] = max(self._released[index][slot], seq)

    def write(self, header: FrameHeader, payload: torch.Tensor | bytes | None = None) -> int:
        """Write one frame (payload copied into the slot); returns its sequence number."""
        seq = self._next_seq
        slot = seq % self.ring.num_slots
        self._drain_releases(block_for=slot if self._written[slot] >= 0 else None)
        target = self.ring.payload(slot)
        nbytes = 0
        if payload is not None:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if isinstance(payload, bytes) else payload
            nbytes = data.numel()
            if nbytes > self.ring.capacity:
                raise TransportError(
                    f"{self._name}: a frame of {nbytes} bytes does not fit a slot of {self.ring.capacity}; "
                    "raise engine.shm.slot_bytes"
                )
            target[:nbytes].copy_(data)
        header.seq = seq
        header.payload_len = nbytes
        header.checksum = header.crc(self.ring.segment.view[self._payload_offset(slot) : self._payload_offset(slot)
                                                            + nbytes])
        if self.tamper is not None:
            self.tamper(header, target[:nbytes])
        header.pack_into(self.ring.header_view(slot))
        self._written[slot] = seq
        self._next_seq += 1
        note = struct.pack("<iq", slot, seq)
        for bell in self._doorbells:
            try:
                bell.send_bytes(note)
            except (BrokenPipeError, ConnectionResetError, OSError):
                raise WorkerDied(_explain(self._alive, f"a consumer of {self._name} is gone")) from None
        return seq

    def progress(self) -> str:
        """How far each consumer got: the one that stalls shows behind the others."""
        with contextlib.suppress(TransportError, WorkerDied):
            self._drain_releases(block_for=None)
        return self._released_so_far()

    def _released_so_far(self) -> str:
        taken = [max(released) for released in self._released]
        return "frames released: " + ", ".join(
            f"{name}: {last + 1}" for name, last in zip(self._consumer_names, taken, strict=True)
        ) + f" of {self._next_seq} sent"

    def _payload_offset(self, slot: int) -> int:
        return slot * self.ring.slot_bytes + HEADER_BYTES


class Consumer:
    """Reads frames in order and validates them; releases slots back to the producer."""

    def __init__(
        self,
        ring: Ring,
        doorbell: Connection,
        release: Connection,
        timeout_s: float,
        alive: Callable[[], str | None] = lambda: None,
        name: str = "ring",
    ) -> None:
        self.ring = ring
        self._doorbell = doorbell
        self._release = release
        self._timeout = timeout_s
        self._alive = alive
        self._name = name
        self._expected = 0

    @property
    def name(self) -> str:
        return self._name

    def read(self, timeout: float | None = None, who: str = "the next frame") -> Frame:
        """The next frame; raises TransportError naming the frame when it is corrupt."""
        _wait_readable(self._doorbell, self._timeout if timeout is None else timeout, f"{who} on {self._name}",
                       self._alive)
        try:
            slot, seq = struct.unpack("<iq", self._doorbell.recv_bytes())
        except EOFError:
            raise WorkerDied(_explain(self._alive, f"the producer of {self._name} closed its pipe")) from None
        where = f"{self._name} frame {seq} (slot {slot})"
        if seq != self._expected or slot != seq % self.ring.num_slots:
            expected = self._expected
            raise TransportError(f"{where}: expected frame {expected} in slot {expected % self.ring.num_slots}")
        header = FrameHeader.unpack_from(self.ring.header_view(slot), where)
        if header.seq != seq:
            raise TransportError(f"{where}: the header says frame {header.seq} (overwritten before it was read)")
        if header.payload_len > self.ring.capacity:
            raise TransportError(
                f"{where}: payload length {header.payload_len} exceeds the slot's {self.ring.capacity}"
            )
        start = slot * self.ring.slot_bytes + HEADER_BYTES
        crc = header.crc(self.ring.segment.view[start : start + header.payload_len])
        if crc != header.checksum:
            raise TransportError(
                f"{where}: bad checksum (header says 0x{header.checksum:08x}, frame is 0x{crc:08x}); "
                "the frame was corrupted or truncated"
            )
        self._expected += 1
        return Frame(header, slot, self.ring.payload(slot)[: header.payload_len])

    def close_pipes(self) -> None:
        self._doorbell.close()
        self._release.close()

    def release(self, frame: Frame) -> None:
        """Give the slot back: the producer may overwrite it from now on."""
        try:
            self._release.send_bytes(struct.pack("<iq", frame.slot, frame.header.seq))
        except (BrokenPipeError, ConnectionResetError, OSError):
            raise WorkerDied(_explain(self._alive, f"the producer of {self._name} is gone")) from None
