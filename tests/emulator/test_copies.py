"""Copy semantics of the stream emulator: when host memory is read, and what outlives what."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch
from holdkit import Hold

from corelib.errors import DeviceError
from corelib.platform.emulator import EmulatedDevice

OpenDevice = Callable[..., EmulatedDevice]


def _h2d_sees(device: EmulatedDevice, source: torch.Tensor) -> float:
    """Copy ``source`` (all ones) behind held work, overwrite it with twos, return what the device got."""
    dst = device.zeros(tuple(source.shape), source.dtype)
    stream = device.stream("h2d")
    held = Hold()
    stream.launch(held)
    stream.copy(dst, source)
    source.fill_(2.0)  # while the copy is known to be queued
    held.release()
    stream.synchronize()
    return float(dst[0])


@pytest.mark.parametrize(
    ("backend", "kind", "seen"),
    [
        ("cuda", "pinned", 2.0),
        ("cuda", "pageable", 1.0),  # staged when issued
        ("cuda", "claims_pinned", 1.0),  # the driver sees through the claim and stages it
        ("npu", "pinned", 2.0),
        ("npu", "pageable", 2.0),  # torch_npu issues the DMA without checking
        ("npu", "claims_pinned", 2.0),  # the second seed: from_blob(pinned_memory=true) over SHM
        ("mlu", "pageable", 1.0),
    ],
)
def test_host_source_is_read_when_the_profile_says(
    emulated: OpenDevice, backend: str, kind: str, seen: float
) -> None:
    device = emulated(backend)
    source = torch.ones(64)
    if kind == "pinned":
        source = device.host_empty((64,), torch.float32, pinned=True)
        source.fill_(1.0)
    elif kind == "claims_pinned":
        device.mark_claims_pinned(source)
    assert _h2d_sees(device, source) == seen


def test_a_view_of_a_registered_buffer_is_registered(emulated: OpenDevice) -> None:
    device = emulated("cuda")
    shm = torch.ones(256)
    with device.register_host(shm):
        assert _h2d_sees(device, shm[64:128]) == 2.0
    shm.fill_(1.0)
    assert _h2d_sees(device, shm[64:128]) == 1.0, "after unregistering it is pageable again (staged)"


def test_freeing_a_pinned_source_before_its_copy_runs_is_caught(emulated: OpenDevice) -> None:
    device = emulated("npu")
    dst = device.zeros((1024,), torch.float32)
    stream = device.stream("h2d")
    held = Hold()
    stream.launch(held)
    source = device.host_empty((1024,), torch.float32, pinned=True)
    stream.copy(dst, source)
    del source  # the engine dropped its input before the copy's event completed
    gc.collect()
    held.release()
    with pytest.raises(DeviceError, match="use-after-free"):
        stream.synchronize()


def test_freeing_a_d2h_destination_before_the_copy_runs_is_caught(emulated: OpenDevice) -> None:
    device = emulated("npu")
    src = device.zeros((16,), torch.float32)
    stream = device.stream("d2h")
    held = Hold()
    stream.launch(held)
    stream.copy(device.host_empty((16,), torch.float32, pinned=True), src)
    gc.collect()
    held.release()
    with pytest.raises(DeviceError, match=r"destination.*use-after-free"):
        stream.synchronize()


def test_a_temporary_view_of_a_live_buffer_is_not_a_use_after_free(emulated: OpenDevice) -> None:
    device = emulated("npu")
    buffer = device.host_empty((8,), torch.float32, pinned=True)
    buffer.copy_(torch.arange(8.0))
    dst = device.zeros((4,), torch.float32)
    stream = device.stream("h2d")
    held = Hold()
    stream.launch(held)
    stream.copy(dst, buffer[2:6])  # the view object dies at once; its storage lives on
    gc.collect()
    held.release()
    stream.synchronize()
    assert dst.tolist() == [2.0, 3.0, 4.0, 5.0]


def test_a_staged_pageable_source_may_be_freed_at_once(emulated: OpenDevice) -> None:
    device = emulated("cuda")
    dst = device.zeros((8,), torch.float32)
    stream = device.stream("h2d")
    held = Hold()
    stream.launch(held)
    stream.copy(dst, torch.full((8,), 3.0))
    gc.collect()
    held.release()
    stream.synchronize()
    assert dst.tolist() == [3.0] * 8


def test_d2h_into_pageable_memory_returns_when_done_on_a_staging_profile(emulated: OpenDevice) -> None:
    for backend, done_on_return in (("cuda", True), ("npu", False)):
        device = emulated(backend)
        src = device.zeros((4,), torch.float32)
        host = torch.zeros(4)
        stream = device.stream("d2h")
        # Held work before the copy: a copy that returns only when done waits for it to end (here by
        # its short timeout); one that returns at once finds the fill still queued.
        held = Hold(timeout_s=0.2 if done_on_return else 30.0)
        stream.launch(held)
        stream.launch(lambda src=src: src.fill_(5.0))  # type: ignore[misc]
        stream.copy(host, src)
        assert (host.tolist() == [5.0] * 4) is done_on_return, backend
        held.release()
        stream.synchronize()
        assert host.tolist() == [5.0] * 4


def test_memory_cannot_be_registered_twice(emulated: OpenDevice) -> None:
    device = emulated("npu")
    pinned = device.host_empty((16,), torch.float32, pinned=True)
    with pytest.raises(ValueError, match="already"):
        device.register_host(pinned)
    buffer = torch.zeros(16)
    device.mark_claims_pinned(buffer)
    with pytest.raises(ValueError, match="claims_pinned"):
        device.register_host(buffer)


def test_copy_bandwidth_of_the_cost_model_is_honoured(emulated: OpenDevice) -> None:
    device = emulated("npu", copy_gb_per_s=0.01)  # 1 MiB takes about 0.1 s
    src, dst = device.zeros((262144,), torch.float32), device.zeros((262144,), torch.float32)
    stream = device.stream("copy")
    start = stream.record(device.event(timing=True, name="start"))
    stream.copy(dst, src)
    end = stream.record(device.event(timing=True, name="end"))
    end.synchronize()
    assert start.elapsed_ms(end) >= 100.0  # a lower bound the model guarantees, not a speed claim
