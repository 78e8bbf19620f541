"""Emulated streams, events and graphs on top of the workers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from corelib.errors import DeviceTimeout, UnsupportedOperation
from corelib.platform.device import DeviceFn, Event, Stream
from corelib.platform.emulator.ops import CopyOp, HostRef, LaunchOp, StrongRef, TensorRef, UpdateOp, WaitOp
from corelib.platform.emulator.stream_thread import Marker, Op, RecordOp, StreamThread
from corelib.platform.graph import Graph
from corelib.platform.memory import MemoryKind

if TYPE_CHECKING:
    from corelib.platform.emulator.device import EmulatedDevice

_READ_AT_RUN = frozenset({MemoryKind.pinned, MemoryKind.registered})
_TRUSTS_CLAIM = frozenset({MemoryKind.claims_pinned, MemoryKind.pageable})


class EmulatedStream(Stream):
    """A stream whose work runs on a worker thread, in FIFO order."""

    def __init__(self, device: EmulatedDevice, name: str, worker: StreamThread) -> None:
        super().__init__(device, name)
        self.emulator = device
        self.worker = worker
        self._captured: list[Op] | None = None

    @property
    def is_capturing(self) -> bool:
        return self._captured is not None

    def submit(self, ops: list[Op]) -> None:
        if self._captured is not None:
            self._captured.extend(ops)
            return
        self.emulator._check_open()
        self.worker.submit(ops)

    def _launch(self, fn: DeviceFn) -> None:
        self.submit([LaunchOp(fn)])

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        memory = self.emulator.memory
        src_kind, dst_kind = memory.kind_of(src), memory.kind_of(dst)
        staged = self.emulator.capabilities.pageable_h2d_is_staged
        what = f"{_side(src_kind)}-to-{_side(dst_kind)} copy on stream {self.name!r}"
        src_ref: TensorRef
        if src_kind is MemoryKind.device:
            src_ref = StrongRef(src)
        elif src_kind in _READ_AT_RUN or not staged:
            # DMA reads the buffer when the copy runs. Without staging the runtime trusts
            # whatever the buffer claims (torch_npu), so pageable memory is read late too.
            src_ref = HostRef(src)
        else:
            if self.is_capturing:
                raise UnsupportedOperation(
                    f"{self.emulator.name}: a {what} reads pageable host memory, which is staged when the "
                    "copy is issued and so cannot be captured in a graph; copy from pinned memory"
                )
            src_ref = StrongRef(src.clone())
        dst_ref: TensorRef = StrongRef(dst) if dst_kind is MemoryKind.device else HostRef(dst)
        # Like cudaMemcpyAsync into pageable memory: it returns only once the copy is done.
        blocking = staged and dst_kind in _TRUSTS_CLAIM and src_kind is MemoryKind.device
        if blocking and self.is_capturing:
            raise UnsupportedOperation(
                f"{self.emulator.name}: a {what} into pageable host memory cannot be captured in a graph"
            )
        op = CopyOp(dst_ref, src_ref, src.numel() * src.element_size(), what)
        if not blocking:
            self.submit([op])
            return
        marker = Marker(f"{self.name}.pageable_copy", self.name)
        self.submit([op, RecordOp(marker)])
        if not marker.done.wait(self.emulator.default_timeout_s):
            raise DeviceTimeout(
                f"{self.emulator.name}: a {what} into pageable memory did not finish within "
                f"{self.emulator.default_timeout_s:g} s (stream is running {self.worker.running()})"
            )
        marker.raise_if_failed()

    def begin_capture(self) -> None:
        if self._captured is not None:
            raise RuntimeError(f"stream {self.name!r} is already capturing a graph")
        self._captured = []

    def end_capture(self) -> list[Op]:
        captured, self._captured = self._captured or [], None
        return captured

    def check_not_capturing(self, action: str) -> None:
        if self._captured is not None:
            raise UnsupportedOperation(
                f"{self.emulator.name}: cannot {action} on stream {self.name!r} while it captures a graph"
            )


def _side(kind: MemoryKind) -> str:
    return "device" if kind is MemoryKind.device else "host"


class EmulatedEvent(Event):
    """An event: each record is a marker that completes when its worker reaches it."""

    def __init__(self, device: EmulatedDevice, name: str) -> None:
        super().__init__(device, name)
        self._marker: Marker | None = None

    def _record(self, stream: Stream) -> None:
        target = _emulated(stream)
        target.check_not_capturing(f"record event {self.name!r}")
        marker = Marker(self.name, target.name)
        target.submit([RecordOp(marker)])
        self._marker = marker

    def _wait(self, stream: Stream) -> None:
        target = _emulated(stream)
        target.check_not_capturing(f"wait for event {self.name!r}")
        marker = self._marker
        # Like cudaStreamWaitEvent: the wait is for the record made before this call, and
        # waiting for an event never recorded is a no-op.
        if marker is not None:
            target.submit([WaitOp(marker)])

    def _query(self) -> bool:
        marker = self._marker
        if marker is None:
            return True
        if marker.done.is_set():
            marker.raise_if_failed()
            return True
        return False

    def _synchronize(self, timeout: float) -> bool:
        marker = self._marker
        if marker is None:
            return True
        if not marker.done.wait(timeout):
            return False
        marker.raise_if_failed()
        return True

    def _elapsed_ms(self, end: Event) -> float:
        if not isinstance(end, EmulatedEvent):
            raise TypeError(f"elapsed_ms needs two events of the same device, got {type(end).__name__}")
        start_time = self._marker.time if self._marker is not None else None
        end_time = end._marker.time if end._marker is not None else None
        if start_time is None or end_time is None:
            raise RuntimeError(
                f"elapsed_ms needs two completed events ({self.describe()}, {end.describe()}); "
                "synchronize first"
            )
        return (end_time - start_time) * 1e3


class EmulatedGraph(Graph):
    """Captured operations, queued again on every replay; they reuse the same static tensors."""

    def __init__(self, device: EmulatedDevice, name: str) -> None:
        super().__init__(device, name)
        self._ops: list[Op] = []

    def _capture(self, fn: DeviceFn, stream: Stream) -> None:
        target = _emulated(stream)
        target.begin_capture()
        try:
            fn()
        finally:
            captured = target.end_capture()
        self._ops = captured

    def _replay(self, stream: Stream) -> None:
        _emulated(stream).submit(list(self._ops))

    def _update(self, stream: Stream, params: Mapping[str, int]) -> None:
        unknown = sorted(set(params) - set(self.params.as_dict()))
        if unknown:
            raise KeyError(f"graph {self.name!r} has no captured parameters {unknown}")
        target = _emulated(stream)
        target.check_not_capturing(f"update graph {self.name!r}")
        target.submit([UpdateOp(self.name, self.params, params)])

    def _reset(self) -> None:
        self._ops = []


def _emulated(stream: Stream) -> EmulatedStream:
    if not isinstance(stream, EmulatedStream):
        raise TypeError(f"stream {stream.name!r} does not belong to an emulated device")
    return stream
