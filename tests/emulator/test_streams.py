"""Streams, events, failures and shutdown of the stream emulator."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from holdkit import Hold

from corelib.errors import DeviceError, DeviceTimeout
from corelib.platform.emulator import EmulatedDevice
from corelib.platform.emulator.device import _stop_forgotten_devices

OpenDevice = Callable[..., EmulatedDevice]


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_failure_poisons_the_stream_and_names_it(emulated: OpenDevice) -> None:
    device = emulated("npu")
    stream, healthy = device.stream("doomed"), device.stream("healthy")
    ran_after: list[int] = []

    def broken() -> None:
        raise ZeroDivisionError("kernel divided by zero")

    stream.launch(broken)
    stream.launch(lambda: ran_after.append(1))
    with pytest.raises(DeviceError, match="doomed") as caught:
        stream.synchronize()
    cause = caught.value.__cause__
    assert isinstance(cause, ZeroDivisionError) and cause.__traceback__ is not None
    assert ran_after == [], "work queued behind a failure never runs"
    with pytest.raises(DeviceError, match="doomed"):
        device.synchronize()
    healthy.launch(lambda: ran_after.append(2))
    healthy.synchronize()
    assert ran_after == [2], "other streams keep working"


def test_failure_propagates_through_a_cross_stream_wait(emulated: OpenDevice) -> None:
    device = emulated("npu")
    producer, consumer = device.stream("producer"), device.stream("consumer")

    def broken() -> None:
        raise ValueError("bad input")

    producer.launch(broken)
    ready = producer.record(device.event(name="ready"))
    consumer.wait(ready)
    with pytest.raises(DeviceError, match="consumer") as caught:
        consumer.synchronize()
    root = caught.value
    while root.__cause__ is not None:
        root = root.__cause__  # type: ignore[assignment]
    assert isinstance(root, ValueError)


def test_a_wait_that_never_completes_times_out_naming_both_streams(emulated: OpenDevice) -> None:
    device = emulated("npu", timeout_s=0.2)
    slow, waiter = device.stream("slow"), device.stream("waiter")
    stuck = Hold()
    slow.launch(stuck)  # stays until the waiter has given up
    waiter.wait(slow.record(device.event(name="slow-done")))
    try:
        with pytest.raises(DeviceError) as caught:
            waiter.synchronize(timeout=2.0)
    finally:
        stuck.release()
    message = str(caught.value)
    assert "waiter" in message and "slow-done" in message and "'slow'" in message
    assert isinstance(caught.value.__cause__, DeviceTimeout)


def test_wait_is_for_the_record_made_before_it(emulated: OpenDevice) -> None:
    device = emulated("npu")
    a, b = device.stream("a"), device.stream("b")
    event = device.event(name="reused")
    b.wait(event)  # never recorded yet: a no-op, like cudaStreamWaitEvent
    b.synchronize(timeout=1.0)
    assert event.query()
    seen: list[str] = []
    queued, after_b = Hold(), Hold(timeout_s=5.0)
    a.launch(queued)  # the first record is still pending when b's wait is issued
    a.launch(lambda: seen.append("first"))
    a.record(event)
    b.wait(event)
    a.launch(after_b)  # the second record cannot complete before b ran (unless b waits for it: then 5 s)
    a.launch(lambda: seen.append("second"))
    a.record(event)  # a later record does not move the earlier wait
    def on_b() -> None:
        seen.append("b")
        after_b.release()

    b.launch(on_b)
    queued.release()
    device.synchronize()
    assert seen == ["first", "b", "second"]
    assert not after_b.expired, "b waited for the later record"


def test_without_independent_streams_all_work_runs_in_issue_order(emulated: OpenDevice) -> None:
    device = emulated("cuda", streams=False)
    a, b = device.stream("a"), device.stream("b")
    order: list[tuple[str, str]] = []
    held = Hold()
    a.launch(held)  # a's work is still queued when b's is issued
    a.launch(lambda: order.append(("a", threading.current_thread().name)))
    b.launch(lambda: order.append(("b", threading.current_thread().name)))
    held.release()
    b.synchronize()
    assert [name for name, _ in order] == ["a", "b"]
    assert order[0][1] == order[1][1], "both streams' work must run on one queue"


def test_elapsed_time_needs_completed_events(emulated: OpenDevice) -> None:
    device = emulated("npu")
    stream = device.stream("s")
    start = stream.record(device.event(timing=True, name="start"))
    held = Hold()
    stream.launch(held)
    end = stream.record(device.event(timing=True, name="end"))
    try:
        assert held.running.wait(10), "the stream never reached the held work"
        with pytest.raises(RuntimeError, match="completed"):
            start.elapsed_ms(end)
    finally:
        held.release()
    end.synchronize()
    assert start.elapsed_ms(end) > 0.0


def test_close_drains_queued_work(emulated: OpenDevice) -> None:
    device = emulated("npu")
    done: list[int] = []
    holds = [Hold() for _ in range(3)]
    for index, held in enumerate(holds):
        stream = device.stream(f"s{index}")
        stream.launch(held)
        stream.launch(lambda index=index: done.append(index))  # type: ignore[misc]
    closing = threading.Thread(target=device.close)
    closing.start()
    deadline = time.monotonic() + 10
    while not device.is_closed and time.monotonic() < deadline:
        time.sleep(0.001)
    assert device.is_closed and done == [], "close began while every stream still had work queued"
    for held in holds:
        held.release()
    closing.join(10)
    assert not closing.is_alive()
    assert sorted(done) == [0, 1, 2]
    assert device.threads_alive() == []
    with pytest.raises(RuntimeError, match="closed"):
        stream.launch(lambda: None)


def test_close_cancels_work_stuck_past_the_timeout(emulated: OpenDevice) -> None:
    device = emulated("npu", timeout_s=0.1)
    stuck, other = device.stream("stuck"), device.stream("other")
    held = Hold()
    stuck.launch(held)  # stays until close has given up on it
    stuck.launch(lambda: None)
    behind = stuck.record(device.event(name="behind"))
    try:
        with pytest.raises(DeviceTimeout, match="stuck"):
            device.close()  # the blocked closure cannot be interrupted: close says which stream
        with pytest.raises(DeviceError, match="cancelled"):
            behind.synchronize(timeout=0.1)
    finally:
        held.release()
    deadline = time.monotonic() + 10.0
    while device.threads_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert device.threads_alive() == [], "the worker exits once its closure returns"
    del other


def test_devices_never_closed_are_stopped_at_exit(emulated: OpenDevice) -> None:
    device = emulated("mlu")
    device.stream("forgotten").launch(lambda: _sleep(0.01))
    _stop_forgotten_devices()
    assert device.threads_alive() == []
    assert not [t for t in threading.enumerate() if t.name.startswith("corelib-emu-") and t.is_alive()]


def test_device_memory_is_tracked_apart_from_host_memory(emulated: OpenDevice) -> None:
    device = emulated("npu")
    baseline = device.memory_stats()
    x = device.empty((256,), torch.float32)
    pinned = device.host_empty((128,), torch.float32, pinned=True)
    pageable = device.host_empty((128,), torch.float32, pinned=False)
    registration = device.register_host(torch.zeros(64))
    stats = device.memory_stats()
    assert stats.device_bytes == baseline.device_bytes + 1024
    assert stats.pinned_bytes == baseline.pinned_bytes + 512
    assert stats.registered_bytes == baseline.registered_bytes + 256
    del x, pinned, pageable
    registration.close()
    assert device.memory_stats() == baseline, "freed and unregistered memory leaves the books"


def test_an_interrupted_close_drops_queued_work_and_leaves_a_running_closure(emulated: OpenDevice) -> None:
    # Ctrl-C while a long closure runs (a warm-up forward of a graph capture): close must not drain
    # the queue behind it nor wait the closure out, and the interrupt must stay what is raised.
    device = emulated("npu", timeout_s=5.0)
    stream = device.stream("busy")
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []
    def long_closure() -> None:
        started.set()
        release.wait(60)

    stream.launch(long_closure)
    stream.launch(lambda: ran.append("queued"))
    behind = stream.record(device.event(name="behind"))
    assert started.wait(30), "the first closure never started"
    with pytest.raises(KeyboardInterrupt):
        try:
            raise KeyboardInterrupt
        finally:
            device.close()  # while the interrupt unwinds, as a `with` block's exit does
    still_running = not release.is_set() and device.threads_alive() != []
    release.set()
    assert still_running, "close waited for the running closure"
    with pytest.raises(DeviceError, match="cancelled because the run was interrupted"):
        behind.synchronize(timeout=5.0)
    deadline = time.monotonic() + 30
    while device.threads_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert device.threads_alive() == [] and ran == [], "the queued closure ran, or the worker outlived it"
