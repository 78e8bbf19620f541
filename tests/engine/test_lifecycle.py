"""Start, stop and failure paths of the engine leave no thread behind and name what went wrong."""

from __future__ import annotations

import gc
import threading
import time
import traceback
from collections.abc import Iterator

import pytest

from corelib.engine import Engine, SamplingParams
from corelib.errors import DeviceError, DeviceTimeout
from corelib.step.device_steps import DeviceSteps
from corelib.step.runner import ModelRunner
from corelib.support import faults

ASYNC = ["backend=npu", "engine.async_token_handoff=on", "backend.emulator.chaos=0.2"]


@pytest.fixture
def no_new_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        extra = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not extra:
            return
        time.sleep(0.05)
    raise AssertionError(f"threads left behind: {[t.name for t in extra]}")


def test_the_startup_heap_is_frozen_while_the_engine_runs_and_given_back_at_close() -> None:
    gc.unfreeze()  # whatever an earlier test of this process froze
    with Engine.from_overrides(["backend=npu"]) as engine:
        assert gc.get_freeze_count() > 0  # no full collection walks what startup built
        engine.generate([[2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert gc.get_freeze_count() == 0  # an engine that closed leaves its objects to the collector


def test_failed_graph_capture_leaves_no_thread(monkeypatch: pytest.MonkeyPatch, no_new_threads: None) -> None:
    def broken(self: ModelRunner, *args: object) -> None:
        raise RuntimeError("capture exploded")

    monkeypatch.setattr(ModelRunner, "_capture", broken)
    with pytest.raises(RuntimeError, match="capture exploded"):
        Engine.from_overrides([*ASYNC, "engine.graph_capture=upfront"])


def test_a_failed_lazy_capture_stops_the_engine_and_leaves_no_thread(
    monkeypatch: pytest.MonkeyPatch, no_new_threads: None
) -> None:
    def broken(self: ModelRunner, *args: object) -> None:
        raise RuntimeError("capture exploded")

    monkeypatch.setattr(ModelRunner, "_capture", broken)
    with Engine.from_overrides([*ASYNC, "engine.graph_capture=lazy"]) as engine:
        with pytest.raises(RuntimeError, match="capture exploded"):
            engine.generate([[2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
        with pytest.raises(RuntimeError, match="stopped after an error"):
            engine.step()


def test_close_with_steps_in_flight(no_new_threads: None) -> None:
    engine = Engine.from_overrides(ASYNC)
    for i in range(8):
        engine.add_request([i + 2, i + 3], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.core.num_in_flight == 1, "async handoff keeps one step in flight between iterations"
    engine.close()
    engine.close()  # twice is fine
    assert engine.local_device.is_closed


def test_submission_error_reaches_caller_with_its_traceback(
    monkeypatch: pytest.MonkeyPatch, no_new_threads: None
) -> None:
    calls = {"n": 0}
    original = DeviceSteps.submit

    def flaky_submit(self: DeviceSteps, fi: object) -> object:
        calls["n"] += 1
        if calls["n"] == 5:
            raise ValueError("injected failure in submit")
        return original(self, fi)  # type: ignore[arg-type]

    monkeypatch.setattr(DeviceSteps, "submit", flaky_submit)
    with Engine.from_overrides(ASYNC) as engine:
        with pytest.raises(ValueError, match="injected failure") as caught:
            engine.generate([[2, 3], [4, 5]], SamplingParams(max_tokens=20, ignore_eos=True))
        frames = [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
        assert "flaky_submit" in frames
        with pytest.raises(RuntimeError, match="stopped after an error"):
            engine.step()


def test_stalled_device_times_out_naming_the_event(no_new_threads: None) -> None:
    engine = Engine.from_overrides(["backend=npu", "engine.graph=off", "engine.timeout_s=0.3"])
    stalled_event = r"event 'step1\.(end|tokens)' on stream '\w+'.* did not complete"
    # The first decode (the second forward, after the prefill) stalls until the gate opens: the
    # host's wait and close both give up while it is known to be running, whatever the speed.
    with faults.gate("forward", hit=2) as stalled:
        with pytest.raises((DeviceError, DeviceTimeout), match=stalled_event):
            engine.generate([[2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert stalled.reached.is_set(), "the decode never reached the device"
        # The stalled closure cannot be interrupted; close says which stream it could not stop.
        with pytest.raises(DeviceTimeout, match="could not stop streams 'compute'"):
            engine.close()
