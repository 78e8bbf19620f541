"""Rings wired to eventfds inside one process, for transport tests."""

from __future__ import annotations

import os
import select
from dataclasses import dataclass, field

from corelib.step.arena import ArenaLayout
from corelib.transport.doorbell import new_eventfd
from corelib.transport.shm import Consumer, Producer, Ring
from corelib.transport.wire import FrameHeader, FrameKind


@dataclass
class Wired:
    ring: Ring
    producer: Producer
    consumers: list[Consumer]
    fds: list[int] = field(default_factory=list)

    def close(self) -> None:
        self.ring.close()
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


def wire(num_slots: int = 2, slot_bytes: int = 4096, consumers: int = 1, timeout: float = 2.0,
         name: str = "test ring", spin_us: float = 50.0, payload_crc: bool = False) -> Wired:
    ring = Ring.create("test", num_slots, slot_bytes, num_consumers=consumers)
    bells = [new_eventfd() for _ in range(consumers)]
    room = new_eventfd()
    producer = Producer(ring, bells, room, timeout, name=name, spin_us=spin_us, payload_crc=payload_crc)
    ends = [Consumer(ring, i, bells[i], room, timeout, name=name, spin_us=spin_us, payload_crc=payload_crc)
            for i in range(consumers)]
    return Wired(ring, producer, ends, [*bells, room])


def decode_header(layout: ArenaLayout, step: int) -> FrameHeader:
    """The header of step ``step``'s frame: one row decoding one token, its arena in ``layout``."""
    return FrameHeader(FrameKind.step, 0, step_id=step, num_seqs=1, bucket=1, kv_blocks=1, layout=layout.encode(),
                       num_tokens=1, max_query_len=1)


class RecordingPoller:
    """Wraps a waiter's poller: what each blocking wait returned (empty: it timed out).

    With ``corelib.transport.doorbell.CHECK_S`` raised above the waits' timeouts, an empty
    return is a wait that ran out: a test can tell a wake-up by its doorbell or a watched
    descriptor from a timeout without reading a clock.
    """

    def __init__(self, poller: select.poll) -> None:
        self._poller = poller
        self.returned: list[list[tuple[int, int]]] = []

    def register(self, fd: int, mask: int) -> None:
        self._poller.register(fd, mask)

    def poll(self, timeout: int) -> list[tuple[int, int]]:
        events = self._poller.poll(timeout)
        self.returned.append(events)
        return events
