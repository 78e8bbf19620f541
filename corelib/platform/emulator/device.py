"""The emulated device: CPU tensors for memory, one worker thread per stream."""

from __future__ import annotations

import atexit
import itertools
import logging
import sys
import time
import weakref
from typing import TYPE_CHECKING

import torch

from corelib.errors import ConfigError, DeviceTimeout
from corelib.platform.device import Device, Event, MemoryStats, Runtime, Stream
from corelib.platform.emulator.stream import EmulatedEvent, EmulatedGraph, EmulatedStream
from corelib.platform.emulator.stream_thread import Marker, RecordOp, StreamThread
from corelib.platform.graph import Graph
from corelib.platform.memory import HostRegistration, MemoryKind, MemoryLedger

log = logging.getLogger("corelib.emulator")
INTERRUPT_GRACE_S = 0.2  # how long an interrupted close waits for a running closure

if TYPE_CHECKING:
    from corelib.platform.backend import DeviceSpec

_open_devices: weakref.WeakSet[EmulatedDevice] = weakref.WeakSet()
_device_ids = itertools.count()


class EmulatedDevice(Device):
    """A device of the backend named in ``spec``, emulated on the CPU with its profile."""

    def __init__(self, spec: DeviceSpec) -> None:
        emulator = spec.emulator
        if not 0.0 <= float(emulator.chaos) <= 1.0:
            raise ConfigError(f"backend.emulator.chaos: {emulator.chaos} is not in [0, 1]")
        if float(emulator.chaos_max_ms) <= 0.0:
            raise ConfigError(f"backend.emulator.chaos_max_ms: {emulator.chaos_max_ms} must be positive")
        if float(emulator.launch_latency_us) < 0.0 or float(emulator.copy_gb_per_s) < 0.0:
            raise ConfigError("backend.emulator: launch_latency_us and copy_gb_per_s must not be negative")
        super().__init__(
            name=spec.backend,
            runtime=Runtime.emulated,
            capabilities=spec.capabilities,
            torch_device=torch.device("cpu"),
            default_timeout_s=spec.timeout_s,
        )
        self.spec = spec
        self.memory = MemoryLedger()
        self._label = f"{spec.backend}{next(_device_ids)}"
        self._workers: list[StreamThread] = []
        self._serial: StreamThread | None = None
        _open_devices.add(self)

    def mark_claims_pinned(self, tensor: torch.Tensor) -> None:
        """Emulator only: make ``tensor``'s memory claim to be pinned while it is not.

        Models ``from_blob(..., pinned_memory=true)`` over POSIX shared memory (the second
        seed): a runtime that trusts the claim reads the buffer when the copy runs.
        """
        self._check_open()
        self.memory.add(tensor, MemoryKind.claims_pinned)

    def memory_stats(self) -> MemoryStats:
        device = self.memory.nbytes(MemoryKind.device)
        return MemoryStats(
            device_bytes=device,
            pinned_bytes=self.memory.nbytes(MemoryKind.pinned),
            registered_bytes=self.memory.nbytes(MemoryKind.registered),
            reserved_bytes=device,
        )

    def threads_alive(self) -> list[str]:
        """Names of this device's worker threads still running (empty after close)."""
        return [f"{self._label}/{worker.name}" for worker in self._workers if worker.is_alive]

    def _worker(self, name: str) -> StreamThread:
        worker = StreamThread(self.name, name, self.spec.emulator, self.default_timeout_s, label=self._label)
        self._workers.append(worker)
        return worker

    def _stream(self, name: str) -> Stream:
        if self.capabilities.streams:
            return EmulatedStream(self, name, self._worker(name))
        # Without independent streams every stream shares one queue: work runs in issue order.
        if self._serial is None:
            self._serial = self._worker("serial")
        return EmulatedStream(self, name, self._serial)

    def _event(self, *, blocking: bool, timing: bool, name: str) -> Event:
        return EmulatedEvent(self, name)

    def _graph(self, name: str) -> Graph:
        return EmulatedGraph(self, name)

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        self.memory.add(tensor, MemoryKind.device)
        return tensor

    def _host_empty(self, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        if pinned:
            self.memory.add(tensor, MemoryKind.pinned)
        return tensor

    def _register_host(self, tensor: torch.Tensor) -> HostRegistration:
        key = self.memory.key(tensor)
        token = self.memory.add(tensor, MemoryKind.registered)
        return HostRegistration(tensor, release=lambda: self.memory.remove(token, key))

    def _synchronize(self, timeout: float) -> None:
        deadline = time.perf_counter() + timeout
        pending: list[tuple[StreamThread, Marker]] = []
        for worker in self._workers:
            marker = Marker(f"{worker.name}.device_sync", worker.name)
            worker.submit([RecordOp(marker)])
            pending.append((worker, marker))
        for worker, marker in pending:
            if not marker.done.wait(max(deadline - time.perf_counter(), 0.0)):
                raise DeviceTimeout(
                    f"{self.name}: device synchronize gave up after {timeout:g} s: stream {worker.name!r} "
                    f"is still running {worker.running()}"
                )
            marker.raise_if_failed()

    def _quiesce(self) -> None:
        if _interrupted():
            # Ctrl-C (or SIGTERM) is unwinding: drop the queued work instead of draining it, and
            # do not wait long for a closure that is running (a warm-up forward can take seconds).
            self._cancel_and_join("the run was interrupted", INTERRUPT_GRACE_S)
            return
        for worker in self._workers:
            worker.stop()
        deadline = time.perf_counter() + self.default_timeout_s
        try:
            for worker in self._workers:
                worker.join(deadline - time.perf_counter())
        except KeyboardInterrupt:
            self._cancel_and_join("close was interrupted")
            raise
        self._cancel_and_join(f"queued work did not finish within {self.default_timeout_s:g} s of close")

    def _cancel_and_join(self, why: str, grace_s: float | None = None) -> None:
        for worker in self._workers:
            if worker.is_alive:
                worker.cancel(f"{self.name}: cancelled because {why}")
        grace = time.perf_counter() + (min(self.default_timeout_s, 5.0) if grace_s is None else grace_s)
        for worker in self._workers:
            worker.join(grace - time.perf_counter())

    def _close(self) -> None:
        _open_devices.discard(self)
        stuck = [f"{w.name!r} (running {w.running()})" for w in self._workers if w.is_alive]
        if stuck and _interrupted():
            # Its closure finishes on a daemon thread, which then exits (its queue was cancelled);
            # raising here would hide the interrupt the user asked for.
            log.info("%s: interrupted while streams %s still ran; they stop after it", self.name, ", ".join(stuck))
            return
        if stuck:
            raise DeviceTimeout(f"{self.name}: close could not stop streams {', '.join(stuck)}")


def _interrupted() -> bool:
    """Whether a KeyboardInterrupt (Ctrl-C, or SIGTERM as corelib raises it) is unwinding through here."""
    return isinstance(sys.exc_info()[1], KeyboardInterrupt)


@atexit.register
def _stop_forgotten_devices() -> None:
    # A device nobody closed: its queued work is abandoned, not drained, so exit stays quick.
    for device in list(_open_devices):
        device._closed = True
        _open_devices.discard(device)
        device._cancel_and_join("the interpreter is exiting and the device was never closed")
