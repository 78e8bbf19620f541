"""Input staging: how a step's packed inputs get to where the model reads them.

One strategy per engine, chosen once at startup (``EngineOptions.staging``):

- ``inline``: the host packed the step into pinned memory it owns; the H2D runs on the
  compute stream, in order with the forward.
- ``host``: the device reads host memory (the cpu backend): no device copy at all. A frame from
  shared memory is read where it is, in its ring slot, which goes back once the step is done.
- ``ordered`` (SHM): at submit, the H2D runs on the prepare stream after the previous step
  stopped reading the device arena, and a ready event gates graph update and replay on the
  compute stream; the prepare stream runs the steps' H2Ds in order, so no step's inputs reach
  the device before the earlier step's have. Where the device registers host memory
  (``capabilities.host_register``; the worker registers the ring) the H2D reads the ring slot
  itself, which goes back once that copy is done: no host copy on the way. Elsewhere, on
  arrival, one contiguous copy of the frame's arena into a pinned snapshot owned by the step,
  and the ring slot is released at once.
- ``early`` (SHM): on arrival, the receiving thread issues the H2D itself, straight from the
  ring slot, on its own stream, and releases the ring slot at once. Nothing orders that copy with
  the producer's next write: on a device that reads the source when the copy runs (pinned or
  registered memory, npu's unchecked DMA), the step may read the next frame's bytes.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from corelib.config.options import Staging
from corelib.platform.device import Device, Event, Stream
from corelib.step.arena import ArenaPool
from corelib.step.forward_input import ForwardInput

_RELEASING = threading.Lock()  # a step's inputs are given back by the first of two threads to see them done


@dataclass
class Staged:
    """A step's inputs as the device side holds them until the step's output event completes."""

    fi: ForwardInput
    source: torch.Tensor  # what the H2D reads (host), or the device buffer the early H2D filled
    ready: Event | None = None  # early: completes when the receiving thread's H2D has landed
    _release: Callable[[], None] | None = None

    def release(self) -> None:
        """The device no longer reads ``source``: give it back (once, whichever thread calls first)."""
        with _RELEASING:
            callback, self._release = self._release, None
        if callback is not None:
            callback()

    @property
    def released(self) -> bool:
        return self._release is None


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

    def release_read(self) -> None:  # noqa: B027 - only a stager that reads ring slots in place has any
        """Give back the inputs the device has finished reading before their step is done (any thread)."""

    def close(self) -> None:  # noqa: B027 - most stagers hold nothing
        """Release what the stager holds."""


class HostStager(InputStager):
    """The device reads host memory: the model reads the packed arena where it is, a ring slot included."""

    mode = Staging.host

    def receive(self, fi: ForwardInput, release_ring_slot: Callable[[], None]) -> Staged:
        return Staged(fi, fi.arena, None, release_ring_slot)  # the slot goes back once the step is done

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
    """The H2D on the prepare stream, a ready event before the forward; from the registered ring slot itself
    (``in_place``), else from a pinned snapshot per step."""

    mode = Staging.ordered

    def __init__(self, device: Device, compute: Stream, snapshot_bytes: int, snapshots: int, timeout_s: float,
                 in_place: bool = False) -> None:
        super().__init__(device, compute)
        self.prepare = device.stream("prepare")
        self.in_place = in_place
        self._pool = None if in_place else ArenaPool(
            lambda shape, dtype: device.host_empty(shape, dtype, pinned=True), snapshot_bytes, snapshots, timeout_s,
            "pinned input snapshot")
        self._ready = device.event(name="inputs.ready")
        self._consumed = device.event(name="inputs.consumed")
        self._any_consumed = False
        # In place: the H2D of each step still reading its ring slot, oldest first, with the event that says
        # the copy is done and what gives the slot back.
        self._reading: deque[tuple[Event, Staged]] = deque()
        self._copied = [device.event(name=f"inputs.h2d_done[{i}]") for i in range(max(snapshots, 1))]
        self._next_copied = 0

    def receive(self, fi: ForwardInput, release_ring_slot: Callable[[], None]) -> Staged:
        if self.in_place:
            return Staged(fi, fi.arena, None, release_ring_slot)  # back once the H2D read it
        return _snapshot(self._pool, fi, release_ring_slot)

    def to_device(self, staged: Staged, target: torch.Tensor | None) -> torch.Tensor:
        if target is None:
            return staged.source
        nbytes = staged.fi.layout.nbytes
        if self._any_consumed:
            self.prepare.wait(self._consumed)  # the previous step no longer reads the device arena
        self.prepare.copy(target[:nbytes], staged.source[:nbytes])
        if self.in_place and self.device.capabilities.event_query:
            # The slot can go back as soon as this copy has run, before the step is done (``release_read``).
            reading = self._reading
            while reading and reading[0][1].released:  # given back with their steps
                reading.popleft()
            copied = self._copied[self._next_copied]
            self._next_copied = (self._next_copied + 1) % len(self._copied)
            self.prepare.record(copied)
            reading.append((copied, staged))
        self.prepare.record(self._ready)
        self.compute.wait(self._ready)  # graph update and replay only after the inputs landed
        return target

    def after_forward(self) -> None:
        self.compute.record(self._consumed)
        self._any_consumed = True

    def release_read(self) -> None:
        """Give back the ring slots whose H2D is done, oldest first (the others go back with their steps).
        Called on the thread that stages steps, as ``to_device`` is."""
        reading = self._reading
        while reading:
            copied, staged = reading[0]
            if not staged.released and not copied.query():
                return
            reading.popleft()
            staged.release()


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
                 timeout_s: float, in_place: bool = False) -> InputStager:
    """The stager for ``mode``; ``snapshots`` buffers of ``snapshot_bytes`` where frames are copied (steps in
    flight, for the events of an ``in_place`` ordered stager, whose H2D reads registered ring slots)."""
    if mode is Staging.inline:
        return InlineStager(device, compute)
    if mode is Staging.host:
        return HostStager(device, compute)
    if mode is Staging.ordered:
        return OrderedStager(device, compute, snapshot_bytes, snapshots, timeout_s, in_place)
    return EarlyStager(device, compute, snapshots)


def reads_ring_in_place(mode: Staging, device: Device) -> bool:
    """An ordered stager's H2D reads the ring slot itself where the device registers host memory."""
    return mode is Staging.ordered and device.capabilities.host_register
