"""The operations a stream queues: launches, copies, event waits and graph updates."""

from __future__ import annotations

import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Mapping

import torch

from corelib.errors import DeviceError, DeviceTimeout
from corelib.platform.device import DeviceFn
from corelib.platform.emulator.stream_thread import Marker, Op, StreamThread
from corelib.platform.graph import GraphParams


class LaunchOp(Op):
    def __init__(self, fn: DeviceFn) -> None:
        self.fn = fn

    def run(self, worker: StreamThread) -> None:
        self.fn()

    def describe(self) -> str:
        return f"launch of {getattr(self.fn, '__qualname__', repr(self.fn))}"

    @property
    def is_launch(self) -> bool:
        return True


class TensorRef(ABC):
    """How a queued copy holds one of its tensors."""

    @abstractmethod
    def get(self) -> torch.Tensor | None:
        """The tensor, or None if its memory was freed."""


class StrongRef(TensorRef):
    """Device memory (freed only in stream order, like a caching allocator) or a staging copy."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def get(self) -> torch.Tensor | None:
        return self._tensor


class HostRef(TensorRef):
    """Host memory that a DMA engine reads or writes later: it does not keep the buffer alive.

    Holds the storage weakly and rebuilds the view when the copy runs, so a temporary view of a
    live buffer is fine but a freed buffer is detected.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self._storage = weakref.ref(tensor.untyped_storage())
        self._offset = tensor.storage_offset()
        self._size = tuple(tensor.size())
        self._stride = tuple(tensor.stride())
        self._dtype = tensor.dtype

    def get(self) -> torch.Tensor | None:
        storage = self._storage()
        if storage is None:
            return None
        return torch.empty(0, dtype=self._dtype).set_(storage, self._offset, self._size, self._stride)


class CopyOp(Op):
    def __init__(self, dst: TensorRef, src: TensorRef, nbytes: int, what: str) -> None:
        self.dst = dst
        self.src = src
        self.nbytes = nbytes
        self.what = what

    def run(self, worker: StreamThread) -> None:
        started = time.perf_counter()
        dst, src = self.dst.get(), self.src.get()
        for tensor, role in ((src, "source"), (dst, "destination")):
            if tensor is None:
                raise DeviceError(
                    f"the host buffer ({role}) of a {self.what} was freed before its copy ran "
                    "(use-after-free): keep it alive until an event recorded after the copy completes"
                )
        assert dst is not None and src is not None, "checked above"
        dst.copy_(src)
        remaining = worker.pacer.copy_seconds(self.nbytes) - (time.perf_counter() - started)
        if remaining > 0.0:
            time.sleep(remaining)

    def describe(self) -> str:
        return f"{self.what} of {self.nbytes} bytes"


class WaitOp(Op):
    """The stream blocks until an event recorded on some stream completes."""

    def __init__(self, marker: Marker) -> None:
        self.marker = marker

    def run(self, worker: StreamThread) -> None:
        if not self.marker.done.wait(worker.timeout_s):
            raise DeviceTimeout(
                f"{worker.device_name}: stream {worker.name!r} waited {worker.timeout_s:g} s for event "
                f"{self.marker.event_name!r} on stream {self.marker.stream_name!r}, which did not complete"
            )
        self.marker.raise_if_failed()

    def describe(self) -> str:
        return f"wait for event {self.marker.event_name!r} on stream {self.marker.stream_name!r}"


class UpdateOp(Op):
    """Change captured graph parameters in stream order: replays queued earlier keep the old ones."""

    def __init__(self, graph_name: str, params: GraphParams, values: Mapping[str, int]) -> None:
        self.graph_name = graph_name
        self.params = params
        self.values = dict(values)

    def run(self, worker: StreamThread) -> None:
        self.params._set(self.values)

    def describe(self) -> str:
        return f"update of graph {self.graph_name!r} to {self.values}"
