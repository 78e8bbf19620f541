"""torch on the CPU as a corelib device: every operation runs at once, in issue order."""

from __future__ import annotations

import time

import torch

from corelib.backend import Backend, DeviceSpec
from corelib.device import Availability, Device, DeviceFn, Event, Runtime, Stream


class CpuEvent(Event):
    """Completes when recorded; timing comes from the host clock."""

    def __init__(self, device: Device, name: str) -> None:
        super().__init__(device, name)
        self._time: float | None = None

    def _record(self, stream: Stream) -> None:
        self._time = time.perf_counter()

    def _wait(self, stream: Stream) -> None:
        return None

    def _query(self) -> bool:
        return True

    def _synchronize(self, timeout: float) -> bool:
        return True

    def _elapsed_ms(self, end: Event) -> float:
        if not isinstance(end, CpuEvent) or self._time is None or end._time is None:
            raise RuntimeError(f"elapsed_ms needs two recorded cpu events ({self.name!r}, {end.name!r})")
        return (end._time - self._time) * 1e3


class CpuStream(Stream):
    def _launch(self, fn: DeviceFn) -> None:
        fn()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)


class CpuDevice(Device):
    def _stream(self, name: str) -> Stream:
        return CpuStream(self, name)

    def _event(self, *, blocking: bool, timing: bool, name: str) -> Event:
        return CpuEvent(self, name)

    def _synchronize(self, timeout: float) -> None:
        return None


class CpuBackend(Backend):
    name = "cpu"
    can_emulate = False

    def _probe_native(self) -> Availability:
        threads = torch.get_num_threads()
        return Availability(native=True, reason=f"torch {torch.__version__} on the CPU, {threads} threads")

    def _open_native(self, spec: DeviceSpec) -> Device:
        return CpuDevice(
            name=self.name,
            runtime=Runtime.native,
            capabilities=spec.capabilities,
            torch_device=torch.device("cpu"),
            default_timeout_s=spec.timeout_s,
        )
