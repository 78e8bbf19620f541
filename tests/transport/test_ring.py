"""The SHM ring: frames round-trip, corruption is caught and named, back-pressure holds."""

from __future__ import annotations

import os
import select
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from ringkit import RecordingPoller, Wired, wire

from corelib.errors import TransportError, WorkerDied
from corelib.platform.backend import DeviceSpec
from corelib.platform.device import Capabilities, Runtime
from corelib.transport import doorbell, shm
from corelib.transport.shm import ALWAYS, SHM_DIR, Consumer, Segment, asleep_word, released_word, sweep_stale
from corelib.transport.wire import FrameHeader, FrameKind, sound_header

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
    return FrameHeader(FrameKind.step, 0, step_id=step, num_seqs=3, bucket=4, kv_blocks=2, flags=1,
                       layout=[1, 0, 1, 5])


def test_frames_round_trip_in_order(wired: Make) -> None:
    w = wired()
    for step in range(5):
        payload = torch.arange(16, dtype=torch.int64) + step
        w.producer.write(header(step), payload.view(torch.uint8))
        frame = w.consumers[0].read()
        assert frame.header.step_id == step and frame.header.seq == step and tuple(frame.header.layout) == (1, 0, 1, 5)
        assert torch.equal(frame.payload.view(torch.int64), payload)
        w.consumers[0].release(frame)


def test_a_slot_reused_with_another_layout_and_length_reads_as_written(wired: Make) -> None:
    # The ends cache a layout's packed and decoded words and a slot's payload views: a slot that carries frames
    # of other layouts and lengths in turn must still read back each as it was written, whether its layout came
    # as a tuple (cached by identity, as a step's ArenaLayout.words) or as a list.
    w = wired(num_slots=2)
    layouts: list[tuple[int, ...] | list[int]] = [(1, 0, 1, 2), [1, 0, 1, 4], (1, 0, 1, 8), (1, 0, 1, 2), [1, 0, 1, 3]]
    for step, layout in enumerate(layouts):
        count = layout[-1]
        payload = torch.arange(count, dtype=torch.int64) * (step + 1)
        h = FrameHeader(FrameKind.step, 0, step_id=step, num_seqs=1, bucket=1, layout=layout)
        w.producer.write(h, payload.view(torch.uint8))
        frame = w.consumers[0].read()
        assert tuple(frame.header.layout) == tuple(layout) and frame.header.payload_len == 8 * count
        assert frame.payload.numel() == frame.data.nbytes == 8 * count
        assert torch.equal(frame.payload.view(torch.int64), payload)
        w.consumers[0].release(frame)


_DAMAGE = [
    ("header-bitflip", "bad checksum"),
    ("truncated", "bad checksum"),
    ("version", "frame version 99"),
    ("magic", "bad magic"),
    ("oversize", "exceeds the slot"),
]


def write_damaged(w: Wired, damage: str) -> memoryview:
    """Frame 0 (step 7, a 64-byte payload) written with ``damage`` done to it; returns its slot's header view."""

    def tamper(h: FrameHeader, payload: torch.Tensor) -> None:
        if damage == "bitflip":
            payload[5] ^= 0x10
        elif damage == "header-bitflip":
            h.kv_blocks ^= 0x04
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
    return view


# A payload's bits are checked only with the payload CRC (the test after the next shows it unchecked).
@pytest.mark.parametrize(
    ("damage", "message", "payload_crc"),
    [("bitflip", "bad checksum", True),
     *[(*case, crc) for case in _DAMAGE for crc in (False, True)]],
)
def test_a_corrupt_frame_is_named(wired: Make, damage: str, message: str, payload_crc: bool) -> None:
    w = wired(payload_crc=payload_crc)
    write_damaged(w, damage)
    with pytest.raises(TransportError, match=rf"test ring frame 0 \(slot 0\): .*{message}"):
        w.consumers[0].read()


@pytest.mark.parametrize("damage", ["none", "wrong-frame", *(case for case, _ in _DAMAGE)])
def test_the_one_call_check_passes_a_sound_header_and_nothing_else(wired: Make, damage: str) -> None:
    # The consumer's check of every frame (sound_header): a damaged header comes back None, for the piece-by-piece
    # checks to name (the test above); a sound one as FrameHeader.unpack_from reads it.
    w = wired()
    view = write_damaged(w, damage)
    got = sound_header(view, 1 if damage == "wrong-frame" else 0, w.ring.capacity)
    if damage == "none":
        assert got == FrameHeader.unpack_from(view) and got is not None and got.step_id == 7
    else:
        assert got is None


def test_without_the_payload_crc_the_payload_is_not_read_on_the_hop(wired: Make) -> None:
    # The header's CRC covers the payload's length, not its bytes: a payload changed after the commit reaches
    # the consumer as it is now (the slot is the step's arena, read in place).
    w = wired()
    w.producer.write(header(7), torch.arange(64, dtype=torch.uint8))
    w.ring.payload(0)[5] ^= 0x10
    frame = w.consumers[0].read()
    assert frame.header.payload_len == 64 and int(frame.payload[5]) == 5 ^ 0x10


def test_a_reserved_slot_is_written_in_place_and_published_by_its_commit(wired: Make) -> None:
    w = wired(num_slots=2)
    for step in range(5):
        arena = w.producer.reserve()
        assert w.producer.reserve().data_ptr() == arena.data_ptr(), "reserving again hands out the same slot"
        assert not w.consumers[0].available(), "nothing is published before the commit"
        arena[:16].view(torch.int64)[:] = torch.tensor([step, -step])
        assert w.producer.is_reserved(arena[:16])
        assert w.producer.commit(header(step), 16) == step
        frame = w.consumers[0].read()
        assert frame.payload.data_ptr() == arena.data_ptr(), "the consumer reads the slot the packer wrote"
        assert frame.payload.view(torch.int64).tolist() == [step, -step]
        w.consumers[0].release(frame)


def test_reserve_waits_for_the_slot_to_be_released(wired: Make) -> None:
    w = wired(num_slots=2, timeout=0.3)
    w.producer.write(header(0))
    w.producer.write(header(1))
    held = w.consumers[0].read()
    with pytest.raises(TransportError, match="consumer 0 to release slot 0 of test ring"):
        w.producer.reserve()
    w.consumers[0].release(held)
    assert w.producer.reserve().data_ptr() == w.ring.payload(0).data_ptr()


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


def test_stale_segments_of_dead_processes_are_swept(private_shm: Path) -> None:
    dead = 2**22 + 12345  # above the default pid_max: no such process
    stale = Segment(f"{shm.PREFIX}-{dead}-deadbeef-in", 4096, create=True)
    stale.owner = False  # leave it behind, like a crashed run
    stale.close()
    live = Segment(shm.segment_name("live"), 4096, create=True)
    try:
        removed = sweep_stale()
        assert stale.name in removed and live.name not in removed
        assert not (private_shm / stale.name).exists() and (private_shm / live.name).exists()
    finally:
        live.close()


def blocked(consumer: Consumer) -> bool:
    """Until ``consumer`` is in its blocking wait, past its announcement and re-check (or 10 s).

    From then on only its eventfd or a watched descriptor can wake it before its timeout.
    """
    deadline = time.monotonic() + 10.0
    while not consumer._waiter.sleeps and time.monotonic() < deadline:
        time.sleep(0.001)
    return consumer._waiter.sleeps > 0


def test_a_sleeping_consumer_is_woken_by_the_commit(wired: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    # No periodic wake-up while the test runs: the wait that ends was ended by the doorbell or by
    # the read's timeout, and the poller says which, however long the wake-up took.
    monkeypatch.setattr(doorbell, "CHECK_S", 3600.0)
    w = wired(spin_us=0.0)  # block at once: the eventfd alone must wake the reader
    consumer = w.consumers[0]
    got: list[int] = []
    failed: list[BaseException] = []

    def read() -> None:
        try:
            got.append(consumer.read(timeout=10.0).header.step_id)
        except TransportError as error:
            failed.append(error)

    poller = RecordingPoller(consumer._waiter._poller)
    consumer._waiter._poller = poller  # type: ignore[assignment]
    reader = threading.Thread(target=read)
    reader.start()
    assert blocked(consumer), "the reader never blocked"
    w.ring.words[ALWAYS] = 0  # as with membarrier: the bell rings because the word says it sleeps
    w.producer.write(header(5))
    reader.join(60.0)
    assert not failed, failed
    assert got == [5]
    assert poller.returned[-1] == [(w.fds[0], select.POLLIN)], "the reader woke at its timeout: a missed doorbell"


def test_the_producer_rings_only_a_consumer_that_sleeps(wired: Make) -> None:
    w = wired()
    bell = w.fds[0]  # consumer 0's eventfd
    w.ring.words[ALWAYS] = 0  # as with membarrier: ring only a sleeper
    w.producer.write(header(0))
    with pytest.raises(BlockingIOError):
        os.eventfd_read(bell)  # a spinning consumer costs the producer no system call
    w.ring.words[asleep_word(0)] = 1
    w.producer.write(header(1))
    assert os.eventfd_read(bell) == 1


def test_releases_out_of_order_free_slots_in_order(wired: Make) -> None:
    w = wired(num_slots=3)
    frames = []
    for step in range(3):
        w.producer.write(header(step))
        frames.append(w.consumers[0].read())
    w.consumers[0].release(frames[1])
    assert w.ring.words[released_word(0)] == 0, "frame 0 is still held: its slot must not be reused"
    w.consumers[0].release(frames[0])
    assert w.ring.words[released_word(0)] == 2
    w.consumers[0].release(frames[2])
    assert w.ring.words[released_word(0)] == 3


def test_a_dead_peer_is_named_at_once_while_waiting(wired: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    read_end, write_end = os.pipe()  # stands for a worker's control pipe: its end closes when it dies
    gone: list[str] = []
    w = wired(spin_us=0.0)
    consumer = Consumer(w.ring, 0, w.fds[0], w.fds[-1], 3600.0, alive=lambda: gone[0] if gone else None,
                        name="test ring", watch=[read_end])

    def die() -> None:
        if blocked(consumer):
            gone.append("the producer (pid 1234) was killed by SIGKILL")
            os.close(write_end)

    # No periodic liveness check while the test runs: the wait that ends must have been ended by
    # the closed pipe, not by its timeout, however long the wake-up took on this machine.
    monkeypatch.setattr(doorbell, "CHECK_S", 3600.0)
    poller = RecordingPoller(consumer._waiter._poller)
    consumer._waiter._poller = poller  # type: ignore[assignment]
    killer = threading.Thread(target=die)
    killer.start()
    try:
        with pytest.raises(WorkerDied, match=r"pid 1234\) was killed by SIGKILL"):
            consumer.read(timeout=10.0)
    finally:
        killer.join()
        os.close(read_end)
    assert poller.returned, "the reader never blocked"
    assert any(fd == read_end for fd, _ in poller.returned[-1]), "the death was noticed by a timeout, not at once"


def test_without_membarrier_every_publication_rings(monkeypatch: pytest.MonkeyPatch) -> None:
    from corelib.transport import doorbell

    monkeypatch.setattr(doorbell.membarrier, "register", lambda: False)
    monkeypatch.setattr(doorbell, "STORES_IN_ORDER", True)
    w = wire()
    try:
        assert w.ring.words[ALWAYS] == 1, "a process without the waiters' barrier must mark the ring"
        w.producer.write(header(0))
        assert os.eventfd_read(w.fds[0]) == 1, "the producer must ring even a consumer that does not sleep"
    finally:
        w.close()


def test_a_cpu_that_reorders_stores_refuses_without_membarrier(monkeypatch: pytest.MonkeyPatch,
                                                               private_shm: Path) -> None:
    from corelib.transport import doorbell

    monkeypatch.setattr(doorbell.membarrier, "register", lambda: False)
    monkeypatch.setattr(doorbell, "STORES_IN_ORDER", False)
    with pytest.raises(TransportError, match=r"needs membarrier\(2\).*use engine\.transport=inproc"):
        wire()
    assert not list(private_shm.iterdir()), "the segment of a ring that refused to start was left"


def test_a_waiting_end_spins_less_where_the_hosts_cores_compute_the_step() -> None:
    def spec(runtime: Runtime, on_host: bool) -> DeviceSpec:
        return DeviceSpec("b", runtime, Capabilities(device_is_host=on_host))

    assert doorbell.spin_for(2000.0, spec(Runtime.native, on_host=False).on_host) == 2000.0
    assert doorbell.spin_for(2000.0, spec(Runtime.native, on_host=True).on_host) == doorbell.HOST_SPIN_US
    assert doorbell.spin_for(2000.0, spec(Runtime.emulated, on_host=False).on_host) == doorbell.HOST_SPIN_US
    assert doorbell.spin_for(50.0, spec(Runtime.native, on_host=True).on_host) == 50.0
