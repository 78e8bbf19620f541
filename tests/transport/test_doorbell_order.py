"""Doorbells: a publisher rings only after its counter is stored; a waiter re-checks after it announces sleep.

No timing here: a recording bell notes what a woken peer would find at the moment of the ring,
and a scripted condition turns true exactly between the waiter's announcement and its sleep.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from ringkit import Wired, wire

from corelib.transport.doorbell import Waiter, new_eventfd
from corelib.transport.shm import COMMITTED, released_word
from corelib.transport.wire import FrameHeader, FrameKind


class RecordingBell:
    """Stands in for a peer's doorbell: each ring notes the ring's control word a woken peer would read."""

    def __init__(self, words: memoryview, index: int) -> None:
        self._words = words
        self._index = index
        self.seen: list[int] = []

    def ring(self) -> None:
        self.seen.append(int(self._words[self._index]))


@pytest.fixture
def ring() -> Iterator[Wired]:
    w = wire(num_slots=2)
    yield w
    w.close()


def header(step: int) -> FrameHeader:
    return FrameHeader(FrameKind.step, 0, step_id=step, num_seqs=1, bucket=1, kv_blocks=1)


def test_the_producer_rings_after_it_stores_committed(ring: Wired) -> None:
    bell = RecordingBell(ring.ring.words, COMMITTED)
    ring.producer._bells = [bell]  # type: ignore[list-item]
    for step in range(3):
        ring.producer.write(header(step), torch.zeros(8, dtype=torch.uint8))
        frame = ring.consumers[0].read()
        ring.consumers[0].release(frame)
    assert bell.seen == [1, 2, 3], "a consumer woken by the bell must find the frame committed"


def test_a_consumer_rings_the_producer_after_it_stores_its_release(ring: Wired) -> None:
    consumer = ring.consumers[0]
    bell = RecordingBell(ring.ring.words, released_word(0))
    consumer._room = bell  # type: ignore[assignment]
    for step in range(3):
        ring.producer.write(header(step), torch.zeros(8, dtype=torch.uint8))
        consumer.release(consumer.read())
    assert bell.seen == [1, 2, 3], "a producer woken by the bell must find the slot released"


def test_a_waiter_checks_again_after_it_announced_that_it_sleeps() -> None:
    # The publisher stored its counter just before the announcement, read the control word as
    # "awake" and did not ring: only the re-check after the announcement can see the counter.
    words = memoryview(bytearray(64)).cast("Q")
    fd = new_eventfd()
    try:
        waiter = Waiter(fd, words, 0, spin_us=0.0, alive=lambda: None)
        assert waiter.wait(lambda: words[0] == 1, timeout=2.0)
        assert waiter.sleeps == 0, "the waiter slept although its condition held when it announced"
        assert words[0] == 0, "a waiter that returns no longer says it sleeps"
    finally:
        os.close(fd)
