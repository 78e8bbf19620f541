"""The device interface every backend implements: streams, events and memory (captured graphs:
:mod:`corelib.platform.graph`).

The public methods live here and do the checking (template method); a backend overrides the
private ``_`` methods. Device work is a closure handed to :meth:`Stream.launch`: a native
backend runs it at once under the stream (its kernels are queued), the emulator queues it on
the stream's worker. Either way the host sees results only after an event.

Long: the whole contract a backend implements (streams, events, host memory, registration,
memory queries, capabilities), each method checked here once; split, a backend author would
read the contract in pieces.
"""

from __future__ import annotations

import dataclasses
import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar

import torch

from corelib.errors import DeviceTimeout, UnsupportedOperation
from corelib.platform.memory import HostRegistration, host_memory

if TYPE_CHECKING:
    from corelib.platform.graph import Graph

#: device work: a closure over device tensors. Its return value is ignored, so in-place tensor
#: ops (which return their tensor) can be launched directly.
DeviceFn = Callable[[], object]


class Runtime(str, enum.Enum):
    """How a backend runs: on its own hardware, or on the stream emulator."""

    native = "native"
    emulated = "emulated"


@dataclass(frozen=True)
class Capabilities:
    """Facts about a device that the engine and the feature gates ask for.

    Boolean capabilities may only be narrowed (true to false) by a backend's probe;
    the fields in ``FACTS`` describe behaviour and are fixed by the backend's config.
    """

    streams: bool = False
    events: bool = False
    event_query: bool = False
    event_timing: bool = False
    blocking_sync: bool = False
    graphs: bool = False
    graph_param_update: bool = False
    pinned_host: bool = False
    host_register: bool = False
    async_d2h: bool = False
    pageable_h2d_is_staged: bool = True
    device_is_host: bool = False
    fused_ops: bool = False
    # Device memory that peer devices of a process group map and read directly, with the torch ops
    # that all-reduce through it (torch.distributed._symmetric_memory).
    symmetric_memory: bool = False
    # Programmatic dependent launch: the device starts a kernel while its predecessor is still
    # running (NVIDIA, compute capability 9.0 or newer), and the op provider's kernels can be
    # launched that way (they wait for the predecessor before touching its data).
    programmatic_launch: bool = False
    programmatic_launch_kernels: bool = False
    # Captured graphs replay on the device without the host's Python; false on the stream emulator,
    # where a replay runs the captured work again on the CPU.
    native_graphs: bool = False
    comm_backend: str = "gloo"

    FACTS: ClassVar[frozenset[str]] = frozenset(
        {"pageable_h2d_is_staged", "device_is_host", "comm_backend"}
    )

    @classmethod
    def from_mapping(cls, values: Mapping[str, object]) -> Capabilities:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown capabilities {unknown}; known: {sorted(known)}")
        return cls(**values)  # type: ignore[arg-type]

    def narrow(self, **changes: bool) -> Capabilities:
        """Return a copy with some capabilities switched off. Switching one on is an error."""
        for key, value in changes.items():
            if not hasattr(self, key):
                raise ValueError(f"unknown capability {key!r}")
            if key in self.FACTS:
                raise ValueError(f"{key!r} is a fact of the backend's profile and cannot be narrowed")
            if value and not getattr(self, key):
                raise ValueError(f"a probe may only narrow capabilities; it tried to enable {key!r}")
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def as_dict(self) -> dict[str, bool | str]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Availability:
    """What a backend's probe found: can it run natively here, and if not, why."""

    native: bool
    reason: str
    narrow: Mapping[str, bool] = field(default_factory=dict)


@dataclass(frozen=True)
class MemoryStats:
    """Bytes the device holds for corelib, for leak checks."""

    device_bytes: int
    pinned_bytes: int
    registered_bytes: int
    # What the device's allocator holds, freed blocks of its pools included (a captured graph keeps its pool's):
    # the device bytes, where there is no such allocator.
    reserved_bytes: int = 0


def _check_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"copy shape mismatch: dst {tuple(dst.shape)} vs src {tuple(src.shape)}")
    if dst.dtype != src.dtype:
        raise ValueError(f"copy dtype mismatch: dst {dst.dtype} vs src {src.dtype}")


class Event(ABC):
    """A marker in a stream. The host or another stream can wait for it."""

    def __init__(self, device: Device, name: str) -> None:
        self.device = device
        self.name = name
        self.stream_name: str | None = None

    def record(self, stream: Stream) -> None:
        """Mark the current end of ``stream``'s queue."""
        stream._check_same_device(self)
        self.stream_name = stream.name
        self._record(stream)

    def wait(self, stream: Stream) -> None:
        """Make ``stream`` wait for this event before running later work."""
        stream._check_same_device(self)
        self._wait(stream)

    def query(self) -> bool:
        """True once every operation before the record has finished."""
        if not self.device.capabilities.event_query:
            raise UnsupportedOperation(f"{self.device.name}: events cannot be queried on this device")
        return self._query()

    def synchronize(self, timeout: float | None = None, *, spin: bool = True) -> None:
        """Block the host until the event completes. Releases the GIL; raises on timeout.

        ``spin=False``: wait asleep from the start, where the device can (another thread of this process spins
        on the event's query already, and two spinning threads would take turns at one GIL)."""
        limit = self.device.default_timeout_s if timeout is None else timeout
        if not (self._synchronize(limit) if spin else self._synchronize_asleep(limit)):
            raise DeviceTimeout(
                f"{self.device.name}: event {self.name!r} on stream {self.stream_name!r} "
                f"did not complete within {limit:g} s"
            )

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds between this event and ``end``; both must have completed."""
        if not self.device.capabilities.event_timing:
            raise UnsupportedOperation(f"{self.device.name}: events carry no timing on this device")
        return self._elapsed_ms(end)

    def describe(self) -> str:
        return f"event {self.name!r} on stream {self.stream_name!r}"

    @abstractmethod
    def _record(self, stream: Stream) -> None: ...

    @abstractmethod
    def _wait(self, stream: Stream) -> None: ...

    @abstractmethod
    def _query(self) -> bool: ...

    @abstractmethod
    def _synchronize(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; return False if the event is still pending."""

    def _synchronize_asleep(self, timeout: float) -> bool:
        """:meth:`_synchronize` without a spin first, where the device has such a wait; by default the same."""
        return self._synchronize(timeout)

    @abstractmethod
    def _elapsed_ms(self, end: Event) -> float: ...


class Stream(ABC):
    """An ordered queue of device work."""

    def __init__(self, device: Device, name: str) -> None:
        self.device = device
        self.name = name

    def launch(self, fn: DeviceFn) -> None:
        """Queue device work: ``fn`` reads and writes device tensors and returns nothing."""
        self._launch(fn)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue a non-blocking copy. A host source must stay untouched until an event says done."""
        _check_copy(dst, src)
        self._copy(dst, src)

    def record(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one if None) at the current end of this stream."""
        if event is None:
            event = self.device.event()
        event.record(self)
        return event

    def wait(self, event: Event) -> None:
        """Make this stream wait for ``event``."""
        event.wait(self)

    def synchronize(self, timeout: float | None = None) -> None:
        """Block the host until everything queued so far has run."""
        self.record(self.device.event(name=f"{self.name}.sync")).synchronize(timeout)

    @contextmanager
    def as_current(self) -> Iterator[Stream]:
        """Run host code whose device ops should land on this stream (native backends)."""
        with self._as_current():
            yield self

    def _check_same_device(self, event: Event) -> None:
        if event.device is not self.device:
            raise ValueError(f"event {event.name!r} belongs to another device than stream {self.name!r}")

    @abstractmethod
    def _launch(self, fn: DeviceFn) -> None: ...

    @abstractmethod
    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    @contextmanager
    def _as_current(self) -> Iterator[None]:
        yield


class Device(ABC):
    """One accelerator (or an emulation of one), opened by a backend."""

    def __init__(
        self,
        name: str,
        runtime: Runtime,
        capabilities: Capabilities,
        torch_device: torch.device,
        default_timeout_s: float = 60.0,
    ) -> None:
        self.name = name
        self.runtime = runtime
        self.capabilities = capabilities
        self.torch_device = torch_device
        self.default_timeout_s = default_timeout_s
        self._registrations: list[HostRegistration] = []
        self._closed = False
        self._streams_made = 0

    @property
    def comm_backend(self) -> str:
        return self.capabilities.comm_backend

    @property
    def is_closed(self) -> bool:
        return self._closed

    def stream(self, name: str | None = None) -> Stream:
        """A new stream. Without the ``streams`` capability all streams run in issue order."""
        self._check_open()
        self._streams_made += 1
        return self._stream(name or f"stream{self._streams_made}")

    def event(self, *, blocking: bool = False, timing: bool = False, name: str = "event") -> Event:
        """A new event. ``blocking`` waits without spinning where the device supports it."""
        self._check_open()
        if timing and not self.capabilities.event_timing:
            raise UnsupportedOperation(f"{self.name}: events carry no timing on this device")
        return self._event(blocking=blocking and self.capabilities.blocking_sync, timing=timing, name=name)

    def graph(self, name: str = "graph") -> Graph:
        self._check_open()
        if not self.capabilities.graphs:
            raise UnsupportedOperation(f"{self.name}: this device cannot capture graphs")
        return self._graph(name)

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised device memory."""
        self._check_open()
        return self._empty(tuple(shape), dtype)

    def zeros(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Zeroed device memory (for set-up, not the hot loop), filled on the thread's current stream: a stream of
        the device's own reads it once :meth:`synchronize` has run."""
        out = self.empty(shape, dtype)
        out.zero_()
        return out

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype, *, pinned: bool = True) -> torch.Tensor:
        """Host memory. ``pinned`` is honoured only with the ``pinned_host`` capability."""
        self._check_open()
        return self._host_empty(tuple(shape), dtype, pinned and self.capabilities.pinned_host)

    def register_host(self, tensor: torch.Tensor) -> HostRegistration:
        """Pin existing host memory in place. Close the registration before freeing the memory."""
        self._check_open()
        if not self.capabilities.host_register:
            raise UnsupportedOperation(f"{self.name}: this device cannot register host memory")
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError("register_host needs a contiguous CPU tensor")
        registration = self._register_host(tensor)
        self._registrations.append(registration)
        return registration

    def bind_thread(self) -> None:
        """Make this the calling thread's current device: a thread that launches work on it calls this first
        (kernels without an explicit device, a vendor's current stream, are per thread)."""
        self._check_open()
        self._bind_thread()

    def synchronize(self, timeout: float | None = None) -> None:
        """Block the host until all work on all streams of this device has run."""
        self._synchronize(self.default_timeout_s if timeout is None else timeout)

    def memory_stats(self) -> MemoryStats:
        return MemoryStats(device_bytes=0, pinned_bytes=0, registered_bytes=0)

    def graph_pool_bytes(self) -> int | None:
        """Device memory the captured graphs' shared pool holds; None where the device cannot say."""
        return None

    def memory_info(self) -> tuple[int, int] | None:
        """(free, total) bytes of the memory this device allocates from; None where the device cannot say.

        A device whose memory is the host's (``device_is_host``, the stream emulator) reports the host's
        memory; a native accelerator's backend asks its runtime. The KV pool is sized from it
        (``engine.gpu_memory_utilization``, :mod:`corelib.startup.kv_pool`).
        """
        if self.capabilities.device_is_host or self.runtime is Runtime.emulated:
            return host_memory()
        return None

    def peak_memory_bytes(self) -> int | None:
        """The most device memory allocated at once since :meth:`reset_peak_memory`; None where the device's
        allocator keeps no peak (the KV sizing then estimates a step's activations from the model's shape)."""
        return None

    def reset_peak_memory(self) -> None:
        """Start a new peak for :meth:`peak_memory_bytes` (nothing where there is none)."""
        return None

    def close(self) -> None:
        """Release streams, threads and registrations. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._quiesce()
        finally:
            # Registrations go after queued work has run: a copy still in flight may read them.
            for registration in self._registrations:
                registration.close()
            self._registrations.clear()
            self._close()

    def __enter__(self) -> Device:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"device {self.name!r} is closed")

    @abstractmethod
    def _stream(self, name: str) -> Stream: ...

    @abstractmethod
    def _event(self, *, blocking: bool, timing: bool, name: str) -> Event: ...

    def _graph(self, name: str) -> Graph:
        raise UnsupportedOperation(f"{self.name}: graphs are not implemented")

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.torch_device)

    def _host_empty(self, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pinned)

    def _register_host(self, tensor: torch.Tensor) -> HostRegistration:
        raise UnsupportedOperation(f"{self.name}: host registration is not implemented")

    @abstractmethod
    def _synchronize(self, timeout: float) -> None: ...

    def _bind_thread(self) -> None:
        return None

    def _quiesce(self) -> None:
        """Let queued work finish (or cancel it) before registrations are released."""
        return None

    def _close(self) -> None:
        return None
