"""Small tools the conformance tests share: capability gates and a way to keep a stream busy."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import pytest
import torch

from corelib.platform.device import Device, Runtime, Stream
from corelib.platform.memory import MemoryKind

#: queue device work on ``stream`` that keeps it busy for about ``seconds``
Busy = Callable[[Stream, float], None]

_cycle_rates: dict[str, float] = {}


def require(device: Device, *capabilities: str) -> None:
    """Skip the calling test, naming the capability, unless the device has every one."""
    for capability in capabilities:
        if not getattr(device.capabilities, capability):
            pytest.skip(f"{device.name} ({device.runtime.value}): capability {capability} is false")


def page_aligned_zeros(numel: int) -> torch.Tensor:
    """Pageable float32 host memory on whole pages of its own (host registration pins pages)."""
    page = 4096
    nbytes = -(-numel * 4 // page) * page
    raw = torch.zeros(nbytes + page, dtype=torch.uint8)
    offset = -raw.data_ptr() % page
    return raw[offset : offset + nbytes].view(torch.float32)[:numel]


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of a tensor whose producing work is known to be done."""
    return tensor.detach().to("cpu", copy=True)


def default_busy(device: Device) -> Busy | None:
    """How to keep one of ``device``'s streams busy, or None where nothing can be pending.

    The emulator sleeps on the stream's worker; a native torch device uses its module's
    ``_sleep(cycles)`` kernel (``torch.cuda._sleep``), calibrated once with timing events.
    A synchronous device (no ``streams`` capability) runs work at once, so it gets None.
    """
    if not device.capabilities.streams:
        return None
    if device.runtime is Runtime.emulated:
        return _sleep_on_worker
    sleep = getattr(getattr(device, "module", None), "_sleep", None)
    if not callable(sleep) or not device.capabilities.event_timing:
        return None
    rate = _cycles_per_second(device, sleep)

    def spin(stream: Stream, seconds: float) -> None:
        stream.launch(partial(sleep, max(1, int(seconds * rate))))

    return spin


def _sleep_on_worker(stream: Stream, seconds: float) -> None:
    def busy() -> None:
        time.sleep(seconds)

    stream.launch(busy)


def _cycles_per_second(device: Device, sleep: Callable[[int], None]) -> float:
    key = str(device.torch_device)
    if key not in _cycle_rates:
        stream = device.stream("calibration")
        stream.launch(partial(sleep, 1000))  # loads the kernel, so the timed run measures only spinning
        start = device.event(timing=True, name="calibration.start")
        end = device.event(timing=True, name="calibration.end")
        cycles = 20_000_000
        stream.record(start)
        stream.launch(partial(sleep, cycles))
        stream.record(end)
        end.synchronize()
        _cycle_rates[key] = cycles / max(start.elapsed_ms(end) / 1e3, 1e-6)
    return _cycle_rates[key]


def settle(device: Device) -> None:
    """Finish set-up work (allocation fills run on the current stream of a native device)."""
    device.synchronize()


def busy_or_skip(busy: Busy | None, device: Device) -> Busy:
    if busy is None:
        pytest.skip(
            f"{device.name} ({device.runtime.value}) runs work synchronously: nothing is ever pending"
        )
    return busy


def warm_up(stream: Stream, fn: Callable[[], object]) -> None:
    """Run the work once for real before capturing it, as torch.cuda's graph docs ask:
    lazily loaded kernels and library handles must not first appear inside a capture."""
    stream.launch(fn)
    stream.synchronize()


def reads_late(device: Device, kind: MemoryKind) -> bool:
    """Does a non-blocking H2D read its host source when it runs, not when it is issued?"""
    caps = device.capabilities
    if not caps.streams or caps.device_is_host:
        return False  # the copy runs when issued
    if kind in (MemoryKind.pinned, MemoryKind.registered):
        return True  # DMA straight from page-locked memory
    # pageable or claims-pinned: a staging runtime copies it at once; one that trusts the
    # buffer's claim (torch_npu) issues DMA on it, read late.
    return not caps.pageable_h2d_is_staged
