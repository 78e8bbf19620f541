"""Doorbells: a publisher rings only after its counter is stored; a waiter re-checks after it announces sleep; a
heads-up wakes a sleeping waiter, which then spins.

No timing here: a recording bell notes what a woken peer would find at the moment of the ring,
and a scripted condition turns true exactly between the waiter's announcement and its sleep.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from ringkit import Wired, wire

from corelib.engine.api import Engine
from corelib.engine.sequence import SamplingParams
from corelib.transport.doorbell import Waiter, new_eventfd
from corelib.transport.shm import COMMITTED, asleep_word, released_word
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


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30.0
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within 30 s"
        time.sleep(0.001)


@pytest.mark.parametrize("spins", [True, False], ids=["spinning-waiter", "never-spins"])
def test_a_heads_up_wakes_a_sleeping_consumer_which_then_spins_until_the_frame(spins: bool) -> None:
    # The producer rings with nothing published (an idle engine's first step is on its way), then publishes
    # without ringing: only a consumer that spins after the heads-up sees the frame without sleeping again.
    ring = wire(num_slots=2, spin_us=1.0 if spins else 0.0, timeout=30.0)
    try:
        consumer = ring.consumers[0]
        if spins:
            consumer._waiter._heads_up_spin_s = 60.0  # longer than any pause of this test's threads
        read: list[object] = []
        reader = threading.Thread(target=lambda: read.append(consumer.read(30.0)), daemon=True)
        reader.start()
        asleep, waiter = ring.ring.words, consumer._waiter
        # Counted as asleep once its eventfd is drained: a ring from here on wakes it (an earlier one would be drained).
        _until(lambda: waiter.sleeps == 1, "the consumer's sleep")
        ring.producer.nudge()
        if spins:
            _until(lambda: asleep[asleep_word(0)] == 0, "the consumer's wake-up")
        else:
            _until(lambda: waiter.sleeps == 2, "the consumer's second sleep")
        ring.producer._bells = []  # the frame's own ring is not what wakes it
        ring.producer.write(header(0), torch.zeros(8, dtype=torch.uint8))
        reader.join(30.0)
        assert read, "the consumer never read the frame"
        expected = 1 if spins else 2  # a waiter told never to spin sleeps again (until its liveness check)
        assert waiter.sleeps == expected, f"slept {waiter.sleeps} times, expected {expected}"
    finally:
        ring.close()


def test_a_request_to_an_idle_engine_wakes_the_executor_once() -> None:
    with Engine.from_overrides(["backend=cpu", "model=tiny"]) as engine:
        wakes: list[int] = []
        engine.core.executor.wake = lambda: wakes.append(engine.core.num_in_flight)  # type: ignore[method-assign]
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        engine.generate([[3, 4, 5], [6, 7, 8], [9, 10, 11]], params)  # three requests, one idle engine
        assert wakes == [0], "the first request wakes the executor once; the others find the engine busy"
        engine.generate([[3, 4, 5]], params)
        assert wakes == [0, 0]
        engine.add_requests_sharing_prompt([3, 4, 5], [params, params])  # an API's n: one request, two outputs
        while engine.has_unfinished:
            engine.step()
        assert wakes == [0, 0, 0]
