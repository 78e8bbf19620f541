"""NPU graphs with captured-parameter update through torch_npu's graph task update API.

The pattern follows torch_npu's own documentation of ``graph_task_update_begin``
(torch_npu/npu/graphs.py; op-plugin docs/context/torch_npu-npu-graph_task_update_begin.md):

- capture: the graph first waits for (then resets) an ExternalEvent, and the captured work
  is one task group, ``graph_task_group_begin(stream)`` ... ``graph_task_group_end(stream)``;
- update: on a stream other than the capture stream, ``graph_task_update_begin(stream,
  handle)``, issue the same work again with the new parameters, ``graph_task_update_end``,
  then record the ExternalEvent so that the next replay waits for the update.

Re-issuing the work means running the captured closure again. It must therefore issue the
same kernels each time and write only into tensors allocated before capture (static
buffers, ``out=`` variants): an allocation inside it would not come from the graph's pool.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from corelib.device import DeviceFn, Stream
from corelib.native import TorchGraph, TorchStream, native_stream

if TYPE_CHECKING:
    from corelib_npu.backend import NpuDevice

TASK_UPDATE_API = (
    "ExternalEvent",
    "graph_task_group_begin",
    "graph_task_group_end",
    "graph_task_update_begin",
    "graph_task_update_end",
)


class NpuGraph(TorchGraph):
    def __init__(self, device: NpuDevice, name: str) -> None:
        super().__init__(device, name)
        self.npu_device = device
        self._fn: DeviceFn | None = None
        self._capture_stream: TorchStream | None = None
        self._handle: Any = None
        self._ready: Any = None
        self._ready_recorded = False

    @property
    def _updatable(self) -> bool:
        return self.device.capabilities.graph_param_update and bool(self.params.as_dict())

    def _capture(self, fn: DeviceFn, stream: Stream) -> None:
        if not self._updatable:
            super()._capture(fn, stream)
            return
        device, npu = self.npu_device, self.npu_device.module
        capture_stream = native_stream(stream).target()
        graph = device.new_native_graph()
        ready = npu.ExternalEvent()
        with npu.device(device.index), device.capturing(graph, native_stream(stream)):
            ready.wait(capture_stream)
            ready.reset(capture_stream)
            npu.graph_task_group_begin(capture_stream)
            fn()
            self._handle = npu.graph_task_group_end(capture_stream)
        self._native, self._fn, self._ready = graph, fn, ready
        self._capture_stream = native_stream(stream)

    def _update(self, stream: Stream, params: Mapping[str, int]) -> None:
        unknown = sorted(set(params) - set(self.params.as_dict()))
        if unknown:
            raise KeyError(f"graph {self.name!r} has no captured parameters {unknown}")
        if self._fn is None or self._capture_stream is None:
            raise RuntimeError(f"graph {self.name!r} was captured without parameters: nothing to update")
        npu, target = self.npu_device.module, native_stream(stream)
        update_stream: Any = self.npu_device.update_stream()
        # Stream order: the update runs after the work already queued on `stream`.
        update_stream.wait_stream(target.target())
        # The closure launches on the capture stream; during the update its work must go to
        # the update stream, where it rewrites the captured tasks instead of running.
        with npu.stream(update_stream), self._capture_stream.redirected(update_stream):
            npu.graph_task_update_begin(update_stream, self._handle)
            self.params._set(params)
            self._fn()
            npu.graph_task_update_end(update_stream)
            self._ready.record(update_stream)
        self._ready_recorded = True

    def _replay(self, stream: Stream) -> None:
        if self._ready is not None and not self._ready_recorded:
            # The captured graph waits for the ExternalEvent on every replay.
            self._ready.record(native_stream(stream).target())
        self._ready_recorded = False
        super()._replay(stream)

    def _reset(self) -> None:
        super()._reset()
        self._fn = self._handle = self._ready = self._capture_stream = None
