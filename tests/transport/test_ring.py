"""The SHM ring: frames round-trip, corruption is caught and named, back-pressure holds."""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Callable, Iterator

import pytest
import torch
from ringkit import Wired, wire

from corelib.engine import shm
from corelib.engine.shm import SHM_DIR, Segment, sweep_stale
from corelib.engine.wire import FrameHeader, FrameKind
from corelib.errors import TransportError

Make = Callable[..., Wired]


@pytest.fixture
def wired() -> Iterator[Make]:
    made: list[Wired] = []

    def make(**kwargs: object) -> Wired:
        result = wire(**kwargs)  # type: ignore[arg-type]
        made.append(result)
        return result

    yield make
    for w in made:
        w.close()


def header(step: int = 0) -> FrameHeader:
    return FrameHeader(FrameKind.decode, 0, step_id=step, num_seqs=3, bucket=4, kv_blocks=2, flags=1,
                       layout=[1, 0, 1, 5])


def test_frames_round_trip_in_order(wired: Make) -> None:
    w = wired()
    for step in range(5):
        payload = torch.arange(16, dtype=torch.int64) + step
        w.producer.write(header(step), payload.view(torch.uint8))
        frame = w.consumers[0].read()
        assert frame.header.step_id == step and frame.header.seq == step and frame.header.layout == [1, 0, 1, 5]
        assert torch.equal(frame.payload.view(torch.int64), payload)
        w.consumers[0].release(frame)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("bitflip", "bad checksum"),
        ("truncated", "bad checksum"),
        ("version", "frame version 99"),
        ("magic", "bad magic"),
        ("oversize", "exceeds the slot"),
    ],
)
def test_a_corrupt_frame_is_named(wired: Make, damage: str, message: str) -> None:
    w = wired()

    def tamper(h: FrameHeader, payload: torch.Tensor) -> None:
        if damage == "bitflip":
            payload[5] ^= 0x10
        elif damage == "truncated":
            h.payload_len -= 8
        elif damage == "oversize":
            h.payload_len = w.ring.capacity + 1

    w.producer.tamper = tamper
    w.producer.write(header(7), torch.arange(64, dtype=torch.uint8))
    view = w.ring.header_view(0)
    if damage == "version":
        struct.pack_into("<H", view, 4, 99)
    elif damage == "magic":
        struct.pack_into("<I", view, 0, 0xDEADBEEF)
    with pytest.raises(TransportError, match=rf"test ring frame 0 \(slot 0\): .*{message}"):
        w.consumers[0].read()


def test_back_pressure_waits_for_every_consumer(wired: Make) -> None:
    w = wired(num_slots=2, consumers=2, timeout=0.3)
    w.producer.write(header(0))
    w.producer.write(header(1))
    first = [c.read() for c in w.consumers]
    w.consumers[0].release(first[0])  # consumer 1 still holds slot 0
    with pytest.raises(TransportError, match="consumer 1 to release slot 0 of test ring"):
        w.producer.write(header(2))
    w.consumers[1].release(first[1])
    assert w.producer.write(header(2)) == 2


def test_a_payload_larger_than_a_slot_is_refused(wired: Make) -> None:
    w = wired(slot_bytes=2048)
    with pytest.raises(TransportError, match=r"raise engine\.shm\.slot_bytes"):
        w.producer.write(header(0), torch.zeros(4096, dtype=torch.uint8))


def test_segments_are_owner_only_and_unlinked(wired: Make) -> None:
    w = wired()
    path = SHM_DIR / w.ring.segment.name
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert w.ring.segment.name.startswith(f"corelib-{os.getpid()}-")
    w.ring.close()
    assert not path.exists()


def test_stale_segments_of_dead_processes_are_swept() -> None:
    dead = 2**22 + 12345  # above the default pid_max: no such process
    stale = Segment(f"{shm.PREFIX}-{dead}-deadbeef-in", 4096, create=True)
    stale.owner = False  # leave it behind, like a crashed run
    stale.close()
    live = Segment(shm.segment_name("live"), 4096, create=True)
    try:
        removed = sweep_stale()
        assert stale.name in removed and live.name not in removed
        assert not (SHM_DIR / stale.name).exists() and (SHM_DIR / live.name).exists()
    finally:
        live.close()
