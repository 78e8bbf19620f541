"""Devices driven through a torch device module: ``torch.cuda``, ``torch_npu.npu`` or ``torch_mlu.mlu``.

torch_npu and torch_mlu mirror torch.cuda's Python API (``Stream``, ``Event``, ``graph``,
``graph_pool_handle``, ``stream``, ``device``, ``current_stream``, ``memory_allocated``), so
one implementation serves all three. A backend subclasses :class:`TorchDevice`, names its
graph class and capture mode, and overrides host registration or graph update where its
vendor offers them; its plugin subclasses :class:`TorchModuleBackend`, which probes and opens
devices of the module. The vendor module is named by the backend: corelib never imports one.

Long: one implementation of every Device method for three vendors' modules, with its blocking-wait
helper; the methods share the module, the index and the pool, so they stay together.
"""

from __future__ import annotations

import importlib
import os
import queue
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, ClassVar

import torch

from corelib.errors import BackendUnavailable, DeviceTimeout, UnsupportedOperation, one_line
from corelib.platform.backend import Backend, DeviceSpec
from corelib.platform.device import (
    Availability,
    Device,
    DeviceFn,
    Event,
    MemoryStats,
    Runtime,
    Stream,
)
from corelib.platform.graph import Graph
from corelib.platform.memory import HostRegistration, MemoryKind, MemoryLedger

SPIN_S = 0.002  # how long a wait spins on its condition before it blocks


def poll_until(
    done: Callable[[], bool], timeout: float, spin_s: float = SPIN_S, block: Callable[[float], bool] | None = None
) -> bool:
    """Wait until ``done()`` is true or ``timeout`` passes; True if it became true.

    Spins on ``done`` (yielding the GIL every turn) for up to ``spin_s``; then hands the rest of
    the wait to ``block(seconds)``, a wait that sleeps until the condition holds or the time is up
    (the vendor's blocking synchronize on a helper thread), or, without one, keeps yielding. No
    fixed sleeps: a short wait costs microseconds and ends the moment the condition holds.
    """
    clock = time.perf_counter
    now = clock()
    deadline = now + timeout
    spin_end = min(deadline, now + spin_s)
    while not done():
        if now >= spin_end:
            break
        os.sched_yield()  # releases the GIL: the threads that make ``done`` true run
        now = clock()
    else:
        return True
    if block is not None:
        return block(max(0.0, deadline - now)) or done()
    while not done():
        if clock() >= deadline:
            return done()
        os.sched_yield()
    return True


class TorchStream(Stream):
    """A native stream; device work is issued at once, under the stream."""

    def __init__(self, device: TorchDevice, name: str, native: Any) -> None:
        super().__init__(device, name)
        self._module: Any = device.module
        self._native: Any = native
        self._redirect: Any = None

    @property
    def native(self) -> object:
        """The vendor stream object (``torch.cuda.Stream`` and its mirrors)."""
        return self._native

    def target(self) -> Any:
        return self._redirect if self._redirect is not None else self._native

    @contextmanager
    def redirected(self, native: object) -> Iterator[None]:
        """Issue this stream's work on ``native`` for a while (a graph update stream)."""
        previous, self._redirect = self._redirect, native
        try:
            yield
        finally:
            self._redirect = previous

    def _launch(self, fn: DeviceFn) -> None:
        with self._module.stream(self.target()):
            fn()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self._module.stream(self.target()):
            dst.copy_(src, non_blocking=True)

    @contextmanager
    def _as_current(self) -> Iterator[None]:
        with self._module.stream(self.target()):
            yield


class TorchEvent(Event):
    def __init__(self, device: TorchDevice, name: str, *, blocking: bool, timing: bool) -> None:
        super().__init__(device, name)
        self._native: Any = device.module.Event(enable_timing=timing, blocking=blocking)

    def _record(self, stream: Stream) -> None:
        self._native.record(native_stream(stream).target())

    def _wait(self, stream: Stream) -> None:
        self._native.wait(native_stream(stream).target())

    def _query(self) -> bool:
        return bool(self._native.query())

    def _synchronize(self, timeout: float) -> bool:
        # Spin on query() first (a step's tokens are usually a fraction of a millisecond away);
        # past that, the vendor's synchronize() sleeps until the event completes, but cannot time
        # out: it runs on the device's helper thread while this one waits for it, bounded.
        return self._poll(timeout, SPIN_S)

    def _synchronize_asleep(self, timeout: float) -> bool:
        return self._poll(timeout, 0.0)

    def _poll(self, timeout: float, spin_s: float) -> bool:
        device = self.device
        assert isinstance(device, TorchDevice), "a TorchEvent belongs to a TorchDevice"
        return poll_until(self._query, timeout, spin_s,
                          block=lambda left: device.blocking.run(self._native.synchronize, left))

    def _elapsed_ms(self, end: Event) -> float:
        if not isinstance(end, TorchEvent):
            raise TypeError(f"elapsed_ms needs two events of the same device, got {type(end).__name__}")
        return float(self._native.elapsed_time(end._native))


HELPER_JOIN_S = 5.0  #: how long closing a device waits for its helper thread (at once, unless a vendor call hangs)


class BlockingCalls:
    """One helper thread per device for the vendor's blocking waits, which cannot time out: the caller
    waits for the call with a timeout, without sleeping a fixed time and without the GIL.

    A call that never returns (a hung device) keeps the helper; the caller's wait still ends at its
    timeout, and the daemon thread goes with the process.
    """

    def __init__(self, name: str, bind: Callable[[], None]) -> None:
        self._name = name
        self._bind = bind
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], threading.Event, list[BaseException]] | None] = (
            queue.SimpleQueue())
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, call: Callable[[], object], timeout: float) -> bool:
        """True once ``call()`` returned (its exception is raised here), False after ``timeout`` seconds."""
        done, failure = threading.Event(), list[BaseException]()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=f"{self._name}-blocking", daemon=True)
                self._thread.start()
            self._calls.put((call, done, failure))
        if not done.wait(timeout):
            return False
        if failure:
            raise failure[0]
        return True

    def _serve(self) -> None:
        self._bind()
        while True:
            item = self._calls.get()
            if item is None:
                return
            call, done, failure = item
            try:
                call()
            except BaseException as error:  # noqa: BLE001 - handed to the waiting caller
                failure.append(error)
            done.set()

    def close(self, timeout: float) -> None:
        """Stop the helper and join it, at most ``timeout`` seconds (a helper stuck in a hung call stays)."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._calls.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


class TorchGraph(Graph):
    """A vendor graph captured with the device's shared memory pool."""

    def __init__(self, device: TorchDevice, name: str) -> None:
        super().__init__(device, name)
        self.torch_device = device
        self._native: Any = None

    def _capture(self, fn: DeviceFn, stream: Stream) -> None:
        device = self.torch_device
        graph = device.new_native_graph()
        with device.module.device(device.index), device.capturing(graph, native_stream(stream)):
            fn()
        self._native = graph

    def _replay(self, stream: Stream) -> None:
        with self.torch_device.module.stream(native_stream(stream).target()):
            self._native.replay()

    def _reset(self) -> None:
        if self._native is not None:
            self._native.reset()
        self._native = None


class TorchDevice(Device):
    """One device of a torch device module. Subclasses set the class attributes below."""

    #: attribute of the module holding the graph class (CUDAGraph, NPUGraph, MLUGraph)
    graph_class: ClassVar[str] = "CUDAGraph"
    #: capture mode: thread_local lets other threads (an engine's pollers) keep querying events
    capture_error_mode: ClassVar[str] = "thread_local"

    def __init__(self, spec: DeviceSpec, module: ModuleType, device_type: str) -> None:
        super().__init__(
            name=spec.backend,
            runtime=Runtime.native,
            capabilities=spec.capabilities,
            torch_device=torch.device(device_type, spec.device_index),
            default_timeout_s=spec.timeout_s,
        )
        self.module: Any = module
        self.index = spec.device_index
        self.memory = MemoryLedger()
        self._streams: list[TorchStream] = []
        self._pool: object | None = None
        self.blocking = BlockingCalls(f"{device_type}{spec.device_index}", self._bind_thread)

    def graph_pool(self) -> object:
        """One memory pool shared by every graph of this device (graphs replay one at a time)."""
        if self._pool is None:
            with self.module.device(self.index):
                self._pool = self.module.graph_pool_handle()
        return self._pool

    def new_native_graph(self) -> Any:
        return getattr(self.module, self.graph_class)()

    def capturing(self, graph: Any, stream: TorchStream) -> Any:
        """The vendor's capture context (``torch.cuda.graph`` and its mirrors)."""
        return self.module.graph(
            graph, pool=self.graph_pool(), stream=stream.target(), capture_error_mode=self.capture_error_mode
        )

    def graph_pool_bytes(self) -> int | None:
        """The segments of the graphs' pool, from the allocator's snapshot (None: no pool, or no snapshot)."""
        snapshot = getattr(self.module, "memory_snapshot", None)
        if self._pool is None or snapshot is None:
            return None
        pool = tuple(self._pool) if isinstance(self._pool, tuple) else (self._pool,)
        return sum(int(s["total_size"]) for s in snapshot() if tuple(s.get("segment_pool_id", ())) == pool)

    def memory_info(self) -> tuple[int, int] | None:
        """The runtime's (free, total) of this device (``mem_get_info``); None where the module has none."""
        query = getattr(self.module, "mem_get_info", None)
        if query is None:
            return None
        free, total = query(self.index)
        return int(free), int(total)

    def peak_memory_bytes(self) -> int | None:
        peak = getattr(self.module, "max_memory_allocated", None)
        return None if peak is None else int(peak(self.index))

    def reset_peak_memory(self) -> None:
        reset = getattr(self.module, "reset_peak_memory_stats", None)
        if reset is not None:
            reset(self.index)

    def memory_stats(self) -> MemoryStats:
        return MemoryStats(
            device_bytes=int(self.module.memory_allocated(self.index)),
            pinned_bytes=self.memory.nbytes(MemoryKind.pinned),
            registered_bytes=self.memory.nbytes(MemoryKind.registered),
            reserved_bytes=int(getattr(self.module, "memory_reserved", self.module.memory_allocated)(self.index)),
        )

    def _stream(self, name: str) -> Stream:
        stream = TorchStream(self, name, self.module.Stream(device=self.index))
        self._streams.append(stream)
        return stream

    def _event(self, *, blocking: bool, timing: bool, name: str) -> Event:
        with self.module.device(self.index):
            return TorchEvent(self, name, blocking=blocking, timing=timing)

    def _graph(self, name: str) -> Graph:
        return TorchGraph(self, name)

    def _host_empty(self, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pinned)
        if pinned:
            self.memory.add(tensor, MemoryKind.pinned)
        return tensor

    def _register_host(self, tensor: torch.Tensor) -> HostRegistration:
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        key = self.memory.key(tensor)
        token = self.memory.add(tensor, MemoryKind.registered)
        try:
            self._pin(ptr, nbytes)
        except BaseException:
            self.memory.remove(token, key)
            raise

        def release() -> None:
            self.memory.remove(token, key)
            self._unpin(ptr)

        return HostRegistration(tensor, release)

    def _pin(self, ptr: int, nbytes: int) -> None:
        """Page-lock ``nbytes`` of host memory at ``ptr`` in place."""
        raise UnsupportedOperation(f"{self.name}: host registration is not implemented")

    def _unpin(self, ptr: int) -> None:
        raise UnsupportedOperation(f"{self.name}: host registration is not implemented")

    def _synchronize(self, timeout: float) -> None:
        streams = [stream._native for stream in self._streams]
        streams += [self.module.current_stream(self.index), self.module.default_stream(self.index)]
        if not poll_until(lambda: all(stream.query() for stream in streams), timeout,
                          block=lambda left: self.blocking.run(lambda: self.module.synchronize(self.index), left)):
            busy = [s.name for s in self._streams if not s._native.query()] or ["the current/default stream"]
            raise DeviceTimeout(
                f"{self.name}: device synchronize gave up after {timeout:g} s; still busy: {busy}"
            )

    def _quiesce(self) -> None:
        self._synchronize(self.default_timeout_s)

    def _bind_thread(self) -> None:
        set_device = getattr(self.module, "set_device", None)  # every torch.cuda mirror has it; a stand-in may not
        if set_device is not None:
            set_device(self.index)

    def _close(self) -> None:
        self.blocking.close(min(self.default_timeout_s, HELPER_JOIN_S))


def native_stream(stream: Stream) -> TorchStream:
    if not isinstance(stream, TorchStream):
        raise TypeError(f"stream {stream.name!r} does not belong to a native torch device")
    return stream


class TorchModuleBackend(Backend):
    """A backend driven by a torch device module: import the vendor package, count devices, open one.

    A subclass names its package, device module, device type and visibility variable, builds its
    device in ``_device``, and may narrow capabilities its installed version lacks (``_narrow``).
    """

    package: ClassVar[str]  # the vendor package, imported first ("torch_npu"); a failure is the reason
    module_name: ClassVar[str]  # the device module ("torch_npu.npu")
    device_type: ClassVar[str]  # torch's device type ("npu")
    visible_env: ClassVar[str]  # the variable that picks the visible devices
    device_label: ClassVar[str]  # how people call one device ("NPU")

    def _import_module(self) -> ModuleType:
        importlib.import_module(self.package)
        return importlib.import_module(self.module_name)

    def _visible(self) -> str:
        return f"{self.visible_env}={os.environ.get(self.visible_env)!r}"

    def _version(self) -> str:
        return str(getattr(importlib.import_module(self.package), "__version__", "unknown version"))

    def _narrow(self, module: Any) -> dict[str, bool]:
        """Capabilities the installed vendor module lacks (none by default)."""
        del module
        return {}

    def _describe(self, module: Any, count: int) -> str:
        """One line on what the probe found."""
        del module
        return f"{count} {self.device_label}(s), {self.package} {self._version()} ({self._visible()})"

    def _probe_native(self) -> Availability:
        try:
            module = self._import_module()
        except Exception as error:  # noqa: BLE001 - ImportError, OSError, RuntimeError alike are reasons
            return Availability(native=False, reason=f"{self.package} cannot be imported ({one_line(error)})")
        count = int(module.device_count())
        if count <= 0:
            seen = f"{self.package} {self._version()} sees no {self.device_label} ({self._visible()})"
            return Availability(native=False, reason=seen)
        return Availability(native=True, reason=self._describe(module, count), narrow=self._narrow(module))

    def _open_native(self, spec: DeviceSpec) -> Device:
        module = self._import_module()
        count = int(module.device_count())
        if not 0 <= spec.device_index < count:
            raise BackendUnavailable(
                f"{self.name}: backend.device_index={spec.device_index} but {count} {self.device_label}s are "
                f"visible ({self._visible()}); the index counts within the visible devices"
            )
        return self._device(spec, module)

    @abstractmethod
    def _device(self, spec: DeviceSpec, module: ModuleType) -> TorchDevice:
        """The device object for ``spec`` on the imported device module."""
