"""The backend conformance suite: what every corelib device must do, checked through its interface.

Each test runs once per target (backend x runtime, see the plugin). Tests of an optional
capability skip, naming it, where the device declares it false. Tests that need a stream to
stay busy (to show that something is still pending) use ``conformance_busy`` and skip where
the device runs work synchronously.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

import pytest
import torch

from corelib.errors import DeviceError, DeviceTimeout, UnsupportedOperation
from corelib.platform.device import Device, Stream
from corelib.platform.memory import MemoryKind
from corelib.testing.helpers import (
    Busy,
    busy_or_skip,
    page_aligned_zeros,
    reads_late,
    require,
    settle,
    to_host,
    warm_up,
)

# The op conformance tests run with the suite (they skip where a backend has no op provider): every one of them.
from corelib.testing.op_conformance import *  # noqa: F403

#: how long a busy stream stays busy: far longer than the host needs to act meanwhile
BUSY_S = 0.1


# -- streams ---------------------------------------------------------------------------------


def _step(x: torch.Tensor, k: int) -> None:
    x.mul_(3).add_(k)


def test_stream_runs_work_in_fifo_order(conformance_device: Device) -> None:
    device = conformance_device
    x = device.zeros((8,), torch.int64)
    settle(device)
    stream = device.stream("fifo")
    expected = 0
    for k in range(1, 13):
        stream.launch(partial(_step, x, k))  # x * 3 + k does not commute: the result encodes the order
        expected = expected * 3 + k
    stream.synchronize()
    assert to_host(x).tolist() == [expected] * 8


def test_wait_orders_work_across_streams(conformance_device: Device, conformance_busy: Busy | None) -> None:
    device = conformance_device
    x, y = device.zeros((4,), torch.float32), device.zeros((4,), torch.float32)
    settle(device)
    producer, consumer = device.stream("producer"), device.stream("consumer")
    if conformance_busy is not None:
        conformance_busy(producer, BUSY_S)  # without the wait, the consumer would read x first
    producer.launch(lambda: x.fill_(7.0))
    ready = producer.record(device.event(name="ready"))
    consumer.wait(ready)
    consumer.launch(lambda: torch.add(x, 1.0, out=y))
    consumer.synchronize()
    assert to_host(y).tolist() == [8.0] * 4


def test_device_synchronize_waits_for_every_stream(
    conformance_device: Device, conformance_busy: Busy | None
) -> None:
    device = conformance_device
    outputs = [device.zeros((4,), torch.float32) for _ in range(3)]
    settle(device)
    for index, out in enumerate(outputs):
        stream = device.stream(f"worker{index}")
        if conformance_busy is not None:
            conformance_busy(stream, BUSY_S)
        stream.launch(partial(out.fill_, float(index + 1)))
    device.synchronize()
    assert [to_host(out).tolist() for out in outputs] == [[1.0] * 4, [2.0] * 4, [3.0] * 4]


def test_device_work_failure_reaches_the_host(conformance_device: Device) -> None:
    device = conformance_device
    stream = device.stream("failing")

    def broken() -> None:
        raise RuntimeError("device work failed on purpose")

    # A native device runs the closure at launch; the emulator raises at the next synchronize.
    with pytest.raises((RuntimeError, DeviceError)) as caught:
        stream.launch(broken)
        stream.synchronize()
    if isinstance(caught.value, DeviceError):
        assert "failing" in str(caught.value), "the error names the stream"
        assert isinstance(caught.value.__cause__, RuntimeError), "the original exception is the cause"
        assert caught.value.__cause__.__traceback__ is not None, "with its traceback"


# -- events ----------------------------------------------------------------------------------


def test_event_query_reports_pending_then_done(
    conformance_device: Device, conformance_busy: Busy | None
) -> None:
    device = conformance_device
    require(device, "event_query")
    stream = device.stream("query")
    if conformance_busy is not None:
        conformance_busy(stream, BUSY_S)
    done = stream.record(device.event(name="done"))
    if conformance_busy is not None:
        assert not done.query(), "an event behind busy work is still pending"
    done.synchronize()
    assert done.query()


@pytest.mark.parametrize("spin", [True, False], ids=["spin", "asleep"])  # asleep: another thread spins on it
def test_event_synchronize_times_out_naming_event_and_stream(
    conformance_device: Device, conformance_busy: Busy | None, spin: bool
) -> None:
    device = conformance_device
    busy = busy_or_skip(conformance_busy, device)
    stream = device.stream("slow-stream")
    busy(stream, 2 * BUSY_S)
    late = stream.record(device.event(blocking=not spin, name="late-event"))
    with pytest.raises(DeviceTimeout) as caught:
        late.synchronize(timeout=0.01, spin=spin)
    assert "late-event" in str(caught.value) and "slow-stream" in str(caught.value)
    late.synchronize(spin=spin)  # it does complete; the timeout only gave up waiting
    assert not device.capabilities.event_query or late.query()


def test_elapsed_time_is_monotonic(conformance_device: Device, conformance_busy: Busy | None) -> None:
    device = conformance_device
    require(device, "event_timing")
    stream = device.stream("timed")
    marks = [device.event(timing=True, name=f"t{i}") for i in range(3)]
    x = device.zeros((16,), torch.float32)
    settle(device)
    for index, mark in enumerate(marks):
        stream.record(mark)
        if index < len(marks) - 1:
            if conformance_busy is not None:
                conformance_busy(stream, BUSY_S / 5)
            stream.launch(partial(x.add_, 1.0))
    marks[-1].synchronize()
    first, second = marks[0].elapsed_ms(marks[1]), marks[1].elapsed_ms(marks[2])
    total = marks[0].elapsed_ms(marks[2])
    assert first >= 0.0 and second >= 0.0
    assert first <= total and second <= total


# -- graphs ----------------------------------------------------------------------------------


def _affine(src: torch.Tensor, out: torch.Tensor) -> None:
    # In-place only: a graph replays on the same static buffers and allocates nothing.
    out.copy_(src)
    out.mul_(2.0)
    out.add_(1.0)


def test_graph_replays_captured_work_on_static_buffers(conformance_device: Device) -> None:
    device = conformance_device
    require(device, "graphs")
    stream = device.stream("graph")
    static_in, static_out = device.zeros((8,), torch.float32), device.zeros((8,), torch.float32)
    warm_up(stream, partial(_affine, static_in, static_out))
    stream.launch(lambda: static_out.fill_(-1.0))
    stream.synchronize()
    settle(device)
    graph = device.graph("affine")
    graph.capture(lambda: stream.launch(partial(_affine, static_in, static_out)), stream)
    stream.synchronize()
    assert to_host(static_out).tolist() == [-1.0] * 8, "nothing runs for real during capture"
    results = []
    for value in (1.0, 2.0, 3.0):
        stream.launch(partial(static_in.fill_, value))
        graph.replay(stream)
        stream.synchronize()
        results.append(to_host(static_out)[0].item())
    assert results == [3.0, 5.0, 7.0]


def test_graph_capture_while_another_stream_works(
    conformance_device: Device, conformance_busy: Busy | None
) -> None:
    device = conformance_device
    require(device, "graphs")
    capture_stream, other = device.stream("capture"), device.stream("other")
    static_in, static_out = device.zeros((4,), torch.float32), device.zeros((4,), torch.float32)
    side = device.zeros((4,), torch.float32)
    settle(device)
    warm_up(capture_stream, partial(_affine, static_in, static_out))
    if conformance_busy is not None:
        conformance_busy(other, BUSY_S)
    other.launch(lambda: side.fill_(9.0))
    graph = device.graph("while-busy")
    graph.capture(lambda: capture_stream.launch(partial(_affine, static_in, static_out)), capture_stream)
    capture_stream.launch(partial(static_in.fill_, 4.0))
    graph.replay(capture_stream)
    device.synchronize()
    assert to_host(static_out).tolist() == [9.0] * 4
    assert to_host(side).tolist() == [9.0] * 4


def test_graph_update_is_ordered_between_replays(
    conformance_device: Device, conformance_busy: Busy | None
) -> None:
    device = conformance_device
    require(device, "graphs", "graph_param_update")
    stream = device.stream("graph")
    static_in, static_out = device.zeros((4,), torch.float32), device.zeros((4,), torch.float32)
    stream.launch(lambda: static_in.fill_(3.0))
    stream.synchronize()
    settle(device)
    warm_up(stream, lambda: torch.mul(static_in, 2, out=static_out))
    graph = device.graph("scaled")

    def scaled() -> None:
        torch.mul(static_in, graph.params["scale"], out=static_out)

    graph.capture(lambda: stream.launch(scaled), stream, params={"scale": 2})
    before, after = device.zeros((4,), torch.float32), device.zeros((4,), torch.float32)
    settle(device)
    if conformance_busy is not None:
        conformance_busy(stream, BUSY_S)  # an update applied at once, not in stream order, would leak back
    graph.replay(stream)
    stream.copy(before, static_out)
    graph.update(stream, scale=5)
    graph.replay(stream)
    stream.copy(after, static_out)
    stream.synchronize()
    assert (to_host(before).tolist(), to_host(after).tolist()) == ([6.0] * 4, [15.0] * 4)
    with pytest.raises(KeyError):
        graph.update(stream, no_such_param=1)


# -- memory ----------------------------------------------------------------------------------


def test_pinned_d2h_result_is_valid_only_after_its_event(
    conformance_device: Device, conformance_busy: Busy | None
) -> None:
    device = conformance_device
    require(device, "pinned_host", "async_d2h")
    busy = busy_or_skip(conformance_busy, device)
    src = device.zeros((64,), torch.float32)
    host = device.host_empty((64,), torch.float32, pinned=True)
    host.zero_()
    settle(device)
    stream = device.stream("d2h")
    busy(stream, BUSY_S)
    stream.launch(partial(src.fill_, 42.0))
    stream.copy(host, src)
    done = stream.record(device.event(name="d2h-done"))
    assert host.tolist() == [0.0] * 64, "the host buffer holds nothing valid before the event"
    done.synchronize()
    assert host.tolist() == [42.0] * 64


_SOURCE_KINDS = ["pinned", "registered", "pageable", "claims_pinned"]


@pytest.mark.parametrize("kind", _SOURCE_KINDS)
def test_overwriting_a_host_source_after_its_copy(
    conformance_device: Device, conformance_busy: Busy | None, kind: str
) -> None:
    """The pinned-source reuse hazard: overwrite the source right after a non-blocking H2D.

    Where the copy reads its source late, the device must see the NEW value: this proves the
    suite can see the race. Where it cannot (a synchronous device, a staged pageable source),
    the device must see the OLD value.
    """
    device = conformance_device
    memory_kind = MemoryKind(kind)
    source = torch.full((256,), 1.0)
    registration = None
    if memory_kind is MemoryKind.pinned:
        require(device, "pinned_host")
        source = device.host_empty((256,), torch.float32, pinned=True)
        source.fill_(1.0)
    elif memory_kind is MemoryKind.registered:
        require(device, "host_register")
        source = page_aligned_zeros(256)
        source.fill_(1.0)
        registration = device.register_host(source)
    elif memory_kind is MemoryKind.claims_pinned:
        mark = getattr(device, "mark_claims_pinned", None)
        if mark is None:
            pytest.skip("only the emulator can make memory claim to be pinned")
        mark(source)
    late = reads_late(device, memory_kind)
    if late and conformance_busy is None:
        pytest.skip(f"{device.name}: no way to keep a stream busy, so the late read cannot be shown")
    dst = device.zeros((256,), torch.float32)
    settle(device)
    stream = device.stream("h2d")
    if conformance_busy is not None:
        conformance_busy(stream, BUSY_S)
    stream.copy(dst, source)
    source.fill_(2.0)  # the producer reuses its buffer at once
    stream.synchronize()
    seen = sorted(set(to_host(dst).tolist()))
    if registration is not None:
        registration.close()
    assert seen == ([2.0] if late else [1.0]), (
        f"{kind} source on {device.name} ({device.runtime.value}): expected the copy to read the "
        f"{'new' if late else 'old'} value"
    )


def test_host_registration_lifecycle(conformance_device: Device) -> None:
    device = conformance_device
    require(device, "host_register")
    buffer, other = page_aligned_zeros(4096), page_aligned_zeros(4096)
    baseline = device.memory_stats().registered_bytes
    registration = device.register_host(buffer)
    assert registration.is_active
    assert device.memory_stats().registered_bytes == baseline + buffer.nbytes
    with pytest.raises((ValueError, DeviceError)):
        device.register_host(buffer[:1024])  # the same memory twice
    with pytest.raises(ValueError):
        device.register_host(torch.zeros(64, 2).t())  # not contiguous
    registration.close()
    assert not registration.is_active
    assert device.memory_stats().registered_bytes == baseline
    left_open = device.register_host(other)
    device.close()
    assert not left_open.is_active, "close() releases registrations left open"


# -- capabilities and lifecycle --------------------------------------------------------------


def test_missing_capabilities_are_refused(conformance_device: Device) -> None:
    device = conformance_device
    caps = device.capabilities
    refusals: dict[str, Callable[[], object]] = {
        "graphs": device.graph,
        "host_register": partial(device.register_host, torch.zeros(16)),
        "event_timing": partial(device.event, timing=True),
    }
    missing = [name for name in refusals if not getattr(caps, name)]
    update_refused = caps.graphs and not caps.graph_param_update
    if not missing and not update_refused:
        pytest.skip(f"{device.name} has every optional capability; the tests that use them cover them")
    for name in missing:
        with pytest.raises(UnsupportedOperation):
            refusals[name]()
    if update_refused:
        stream = device.stream("graph")
        x = device.zeros((4,), torch.float32)
        settle(device)
        warm_up(stream, partial(x.add_, 1.0))
        graph = device.graph()
        graph.capture(lambda: stream.launch(partial(x.add_, 1.0)), stream, params={"n": 1})
        with pytest.raises(UnsupportedOperation, match="graph"):
            graph.update(stream, n=2)


def test_close_finishes_queued_work_and_joins_every_thread(
    conformance_device: Device, conformance_busy: Busy | None
) -> None:
    device = conformance_device
    before = set(threading.enumerate())
    x = device.zeros((4,), torch.float32)
    settle(device)
    streams: list[Stream] = [device.stream(f"s{i}") for i in range(3)]
    for stream in streams:
        if conformance_busy is not None:
            conformance_busy(stream, BUSY_S / 2)
    streams[-1].launch(partial(x.fill_, 5.0))
    device.close()
    assert [t.name for t in set(threading.enumerate()) - before] == []
    assert to_host(x).tolist() == [5.0] * 4, "work queued before close() was not lost"
    with pytest.raises(RuntimeError):
        device.stream("after-close")
