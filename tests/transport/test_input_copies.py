"""Host copies of a step's inputs over SHM: one, the packer's writes into the ring slot.

Spies count every copy of a step's bytes on either side of the ring: on the scheduler's side a
payload copied into a slot (``Producer.write`` with a payload) or an arena taken from a pool; on
the worker's side a snapshot (``staging._copy_bytes``) and every copy a stream is asked for, by
where it reads and writes. The worker's side runs here with the ring and the stagers a worker
builds, frames written as the scheduler writes them.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from ringkit import Wired, decode_header, wire

from corelib.engine import Engine, SamplingParams
from corelib.platform.device import Device, Stream
from corelib.plugins import PluginRegistry
from corelib.startup.compose import compose_config
from corelib.startup.start import start
from corelib.step import staging
from corelib.step.arena import ArenaPool
from corelib.step.layout import EngineLayout
from corelib.step.staging import build_stager, reads_ring_in_place
from corelib.transport import shm
from corelib.transport.shm_executor import ShmExecutor
from corelib.transport.wire import input_of

STEPS = 12


class Spies:
    """Counts the copies of step inputs by kind; ``ring`` is the segment the slots live in."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: Counter[str] = Counter()
        self.ring: tuple[int, int] | None = None
        self.device: Device | None = None
        as_bytes, copy_bytes, acquire, stream_copy = shm.as_bytes, staging._copy_bytes, ArenaPool.acquire, Stream.copy

        def spy_as_bytes(payload: torch.Tensor | bytes | memoryview) -> memoryview:
            self.counts["payload copied into a slot"] += 1
            return as_bytes(payload)

        def spy_copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
            self.counts["host copy (snapshot)"] += 1
            copy_bytes(dst, src)

        def spy_acquire(pool: ArenaPool) -> torch.Tensor:
            self.counts["arena taken from a pool"] += 1
            return acquire(pool)

        def spy_stream_copy(stream: Stream, dst: torch.Tensor, src: torch.Tensor) -> None:
            self.counts[f"stream copy {self._where(src)} to {self._where(dst)}"] += 1
            stream_copy(stream, dst, src)

        monkeypatch.setattr(shm, "as_bytes", spy_as_bytes)
        monkeypatch.setattr(staging, "_copy_bytes", spy_copy_bytes)
        monkeypatch.setattr(ArenaPool, "acquire", spy_acquire)
        monkeypatch.setattr(Stream, "copy", spy_stream_copy)

    def _where(self, tensor: torch.Tensor) -> str:
        if self.ring is not None and self.ring[0] <= tensor.data_ptr() < self.ring[1]:
            return "ring slot"
        memory = getattr(self.device, "memory", None)
        if memory is not None and memory.kind_of(tensor).value == "device":
            return "device"
        return "host"


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> Spies:
    return Spies(monkeypatch)


@pytest.fixture
def ring() -> Iterator[Wired]:
    wired = wire(num_slots=2, slot_bytes=1 << 20, timeout=30.0)
    yield wired
    wired.close()


def run_steps(overrides: list[str], spies: Spies, wired: Wired) -> None:
    """``STEPS`` decode frames packed in their slots, read and staged as a worker does, each step's device work
    done before its slot may go back."""
    startup = start(compose_config(["model.num_layers=1", "engine.max_num_seqs=4", "model.max_model_len=64",
                                    "engine.transport=shm", *overrides]), PluginRegistry())
    device = startup.backend.open(startup.spec)
    spies.device = device
    whole = wired.ring.whole
    spies.ring = (whole.data_ptr(), whole.data_ptr() + whole.numel())
    mode = startup.options.staging
    in_place = reads_ring_in_place(mode, device)
    registration = device.register_host(whole) if in_place else None
    layout = EngineLayout.of(startup.config).decode_layout
    compute = device.stream("compute")
    stager = build_stager(mode, device, compute, layout.nbytes, 4, 30.0, in_place=in_place)
    target = device.empty((layout.nbytes,), torch.uint8) if not device.capabilities.device_is_host else None
    consumer = wired.consumers[0]
    try:
        for step in range(STEPS):
            arena = wired.producer.reserve()  # what the executor hands the packer
            arena[: layout.nbytes].view(torch.int64).fill_(step)  # the packer's writes
            wired.producer.commit(decode_header(layout, step), layout.nbytes)
            stager.release_read()
            frame = consumer.read()
            fi = input_of(frame.header, frame.payload, "frame")
            staged = stager.receive(fi, functools.partial(consumer.release, frame))
            stager.to_device(staged, target)
            stager.after_forward()
            compute.synchronize()
            staged.release()
    finally:
        device.synchronize()
        if registration is not None:
            registration.close()
        stager.close()
        device.close()


def test_the_cpu_worker_copies_nothing(spies: Spies, ring: Wired) -> None:
    run_steps(["backend=cpu"], spies, ring)
    assert dict(spies.counts) == {}, "the cpu device reads the slot the packer wrote"


def test_the_ordered_worker_on_a_device_that_registers_host_memory_only_copies_the_slot_to_the_device(
    spies: Spies, ring: Wired
) -> None:
    run_steps(["backend=npu", "engine.shm.materialization=ordered"], spies, ring)
    assert dict(spies.counts) == {"stream copy ring slot to device": STEPS}, "one H2D per step, from the slot"


def test_without_host_registration_the_ordered_worker_keeps_its_pinned_snapshot(spies: Spies, ring: Wired) -> None:
    # The mlu cannot register host memory: its H2D reads a pinned snapshot, one host copy per step.
    run_steps(["backend=mlu", "engine.shm.materialization=ordered"], spies, ring)
    assert dict(spies.counts) == {"host copy (snapshot)": STEPS, "stream copy host to device": STEPS,
                                  "arena taken from a pool": STEPS}


@pytest.mark.slow  # an SHM worker
def test_the_scheduler_packs_each_step_into_its_ring_slot_and_copies_nothing(
    spies: Spies, monkeypatch: pytest.MonkeyPatch
) -> None:
    from corelib.engine.packing import InputBuilder

    arenas: list[int] = []
    fill = InputBuilder.fill

    def spy_fill(builder: InputBuilder, step_id: int, step: object, arena: torch.Tensor, *args: int) -> object:
        arenas.append(arena.data_ptr())
        return fill(builder, step_id, step, arena, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(InputBuilder, "fill", spy_fill)
    with Engine.from_overrides(["backend=cpu", "engine.transport=shm", "engine.max_num_seqs=4"]) as engine:
        executor = engine.core.executor
        assert isinstance(executor, ShmExecutor) and executor.in_ring is not None
        whole = executor.in_ring.whole
        outputs = engine.generate([[3, 4, 5], [7, 8]], SamplingParams(max_tokens=6, ignore_eos=True))
        assert all(len(o.output_token_ids) == 6 for o in outputs)
    assert len(arenas) >= 6
    assert all(whole.data_ptr() <= ptr < whole.data_ptr() + whole.numel() for ptr in arenas), \
        "a step was packed outside the ring"
    assert dict(spies.counts) == {}, "the scheduler copied a step's inputs"
