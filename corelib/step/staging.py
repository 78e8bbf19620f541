"""Input staging: how a step's packed inputs get to where the model reads them.

One strategy per engine, chosen once at startup (``EngineOptions.staging``):

- ``inline``: the host packed the step into pinned memory it owns; the H2D runs on the
  compute stream, in order with the forward.
- ``host``: the device reads host memory (the cpu backend): no device copy at all. Frames from
  shared memory are copied into a plain host buffer owned by the step, and the ring slot released.
- ``ordered`` (SHM, as the second seed describes): on arrival, one contiguous copy of the
  frame's arena into a pinned snapshot owned by the step, then the ring slot is released; at submit,
  the H2D runs on the prepare stream after the previous step stopped reading the device arena,
  and a ready event gates graph update and replay on the compute stream.
- ``early`` (SHM): on arrival, the receiving thread issues the H2D itself, straight from the
  ring slot, on its own stream, and releases the ring slot at once. Nothing orders that copy with
  the producer's next write: on a device that reads the source when the copy runs (pinned or
  registered memory, npu's unchecked DMA), the step may read the next frame's bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from corelib.device import Device, Event, Stream
from corelib.options import Staging
from corelib.step.arena import ArenaPool
from corelib.step.forward_input import ForwardInput


@dataclass
class Staged:
    """A step's inputs as the device side holds them until the step's output event completes."""

    fi: ForwardInput
    source: torch.Tensor  # what the H2D reads (host), or the device buffer the early H2D filled
    ready: Event | None = None  # early: completes when the receiving thread's H2D has landed
    _release: Callable[[], None] | None = None

    def release(self) -> None:
        """The device no longer reads ``source``: give it back (called once)."""
        callback, self._release = self._release, None
        if callback is not None:
            callback()


class InputStager(ABC):
    """Moves a step's inputs to the device; ``to_device`` runs in submission order."""

    mode: Staging

    def __init__(self, device: Device, compute: Stream) -> None:
        self.device = device
        self.compute = compute

    def adopt(self, fi: ForwardInput, release: Callable[[], None] | None = None) -> Staged:
        """In process: the arena the host packed belongs to the step until it completes."""
        return Staged(fi, fi.arena, None, release)

    def receive(self, fi: ForwardInput, release_ring_slot: Callable[[], None]) -> Staged:
        """From a shared-memory slot (``fi.arena`` views the slot); ``release_ring_slot`` gives the slot back."""
        raise NotImplementedError(f"{self.mode.value} staging does not read shared memory")

    @abstractmethod
    def to_device(self, staged: Staged, target: torch.Tensor | None) -> torch.Tensor:
        """The arena the model reads: ``target`` (device memory the H2D lands in), or the source itself."""

    def after_forward(self) -> None:  # noqa: B027 - most stagers have nothing to do here
        """Called once the forward is queued behind ``to_device``."""

    def close(self) -> None:  # noqa: B027 - most stagers hold nothing
        """Release what the stager holds."""


class HostStager(InputStager):
    """The device reads host memory: the model reads the packed arena where it is."""

    mode = Staging.host

    def __init__(self, device: Device, compute: Stream, snapshot_bytes: int = 0, snapshots: int = 0,
                 timeout_s: float = 60.0) -> None:
        super().__init__(device, compute)
        self._pool = (ArenaPool(lambda shape, dtype: torch.empty(shape, dtype=dtype), snapshot_bytes, snapshots,
                                  timeout_s, "input snapshot") if snapshots else None)

    def receive(self, fi: ForwardInput, release_ring_slot: Callable[[], None]) -> Staged:
        return _snapshot(self._pool, fi, release_ring_slot)

    def to_device(self, staged: Staged, target: torch.Tensor | None) -> torch.Tensor:
        return staged.source


class InlineStager(InputStager):
    """The H2D on the compute stream, in order with everything else the step does."""

    mode = Staging.inline

    def to_device(self, staged: Staged, target: torch.Tensor | None) -> torch.Tensor:
        if target is None:
            return staged.source
        nbytes = staged.fi.layout.nbytes
        self.compute.copy(target[:nbytes], staged.source[:nbytes])
        return target


class OrderedStager(InputStager):
    """A pinned snapshot per step, the H2D on the prepare stream, a ready event before the forward."""

    mode = Staging.ordered

    def __init__(self, device: Device, compute: Stream, snapshot_bytes: int, snapshots: int, timeout_s: float) -> None:
        super().__init__(device, compute)
        self.prepare = device.stream("prepare")
        self._pool = ArenaPool(lambda shape, dtype: device.host_empty(shape, dtype, pinned=True), snapshot_bytes,
                                 snapshots, timeout_s, "pinned input snapshot")
        self._ready = device.event(name="inputs.ready")
        self._consumed = device.event(name="inputs.consumed")
        self._any_consumed = False

    def receive(self, fi: ForwardInput, release_ring_slot: Callable[[], None]) -> Staged:
        return _snapshot(self._pool, fi, release_ring_slot)

    def to_device(self, staged: Staged, target: torch.Tensor | None) -> torch.Tensor:
        if target is None:
            return staged.source
        nbytes = staged.fi.layout.nbytes
        if self._any_consumed:
            self.prepare.wait(self._consumed)  # the previous step no longer reads the device arena
        self.prepare.copy(target[:nbytes], staged.source[:nbytes])
        self.prepare.record(self._ready)
        self.compute.wait(self._ready)  # graph update and replay only after the inputs landed
        return target

    def after_forward(self) -> None:
        self.compute.record(self._consumed)
        self._any_consumed = True


class EarlyStager(InputStager):
    """The receiving thread issues the H2D straight from the shared slot, and releases it at once."""

    mode = Staging.early

    def __init__(self, device: Device, compute: Stream, in_flight: int) -> None:
        super().__init__(device, compute)
        self.stream = device.stream("polling")
        self._events = [device.event(name=f"inputs.early_h2d[{i}]") for i in range(in_flight)]
        self._next = 0

    def receive(self, fi: ForwardInput, release_ring_slot: Callable[[], None]) -> Staged:
        nbytes = fi.layout.nbytes
        target = self.device.empty((nbytes,), torch.uint8)
        self.stream.copy(target, fi.arena[:nbytes])
        ready = self._events[self._next]
        self._next = (self._next + 1) % len(self._events)
        self.stream.record(ready)
        release_ring_slot()  # the copy may not have read the slot yet: the hazard
        return Staged(fi, target, ready)

    def to_device(self, staged: Staged, target: torch.Tensor | None) -> torch.Tensor:
        if staged.ready is not None:
            self.compute.wait(staged.ready)
        if target is None:
            return staged.source
        nbytes = staged.fi.layout.nbytes
        self.compute.copy(target[:nbytes], staged.source[:nbytes])  # into the graph's static inputs
        return target


_PARALLEL_COPY = 32768  # torch splits a copy of this many elements or more over its thread pool (GRAIN_SIZE)


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One memcpy with the GIL held, for host memory: torch's copy_ splits a decode arena (72 KiB at 128
    rows) over its thread pool, whose fork and join cost several times the copy itself."""
    if dst.numel() >= _PARALLEL_COPY and dst.device.type == "cpu" and src.device.type == "cpu":
        dst.numpy().data[:] = src.numpy().data
    else:
        dst.copy_(src)


def _snapshot(pool: ArenaPool | None, fi: ForwardInput, release_ring_slot: Callable[[], None]) -> Staged:
    """One contiguous copy of the frame's arena into a buffer the step owns; the slot goes back at once."""
    if pool is None:
        raise RuntimeError("this stager was built without snapshot buffers")
    nbytes = fi.layout.nbytes
    snapshot = pool.acquire()
    _copy_bytes(snapshot[:nbytes], fi.arena[:nbytes])
    release_ring_slot()  # the producer may reuse the slot: the step owns its snapshot
    return Staged(fi, snapshot, None, lambda: pool.release(snapshot))


def build_stager(mode: Staging, device: Device, compute: Stream, snapshot_bytes: int, snapshots: int,
                 timeout_s: float) -> InputStager:
    """The stager for ``mode``; ``snapshots`` buffers of ``snapshot_bytes`` where frames are copied."""
    if mode is Staging.inline:
        return InlineStager(device, compute)
    if mode is Staging.host:
        return HostStager(device, compute, snapshot_bytes, snapshots, timeout_s)
    if mode is Staging.ordered:
        return OrderedStager(device, compute, snapshot_bytes, snapshots, timeout_s)
    return EarlyStager(device, compute, snapshots)
