"""The worker's two threads: frames are taken in while a step's tokens are awaited, and nothing sleeps a fixed time.

The worker's step loop runs here in-process between two real rings (the test writes the input
frames and reads the results), around scripted device steps whose tokens come only when the test
opens that step's gate. Nothing is timed: each wait is bounded and says what it waited for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import cast

import pytest
import torch
from ringkit import Wired, wire

from corelib.platform.device import Device, Event, MemoryStats, Stream
from corelib.step.device_steps import DeviceSteps
from corelib.step.fields import step_layout
from corelib.step.forward_input import ForwardInput, StepKind
from corelib.step.handoff import StepHandle, StepResult, StepTiming
from corelib.step.staging import Staged
from corelib.transport.wire import FrameHeader, FrameKind, decode_result
from corelib.transport.worker import StepLoop

WAIT_S = 20.0  # a bound for the test's own waits, never reached when the loop works
LAYOUT = step_layout(2, 2, 2)  # a decode step of two rows, two blocks each


class GateEvent(Event):
    """A step's tokens event that completes when the test opens its gate."""

    def __init__(self, gate: threading.Event) -> None:
        device = SimpleNamespace(capabilities=SimpleNamespace(event_query=True), default_timeout_s=WAIT_S)
        super().__init__(cast(Device, device), "gate")
        self.gate = gate

    def _record(self, stream: Stream) -> None:
        return None

    def _wait(self, stream: Stream) -> None:
        return None

    def _query(self) -> bool:
        return self.gate.is_set()

    def _synchronize(self, timeout: float) -> bool:
        return self.gate.wait(timeout)

    def _elapsed_ms(self, end: Event) -> float:
        return 0.0


class PassStager:
    """Gives the ring slot back at once; the step reads the frame's bytes where they are."""

    def receive(self, fi: ForwardInput, release_ring_slot: Callable[[], None]) -> Staged:
        release_ring_slot()
        return Staged(fi, fi.arena)

    def release_read(self) -> None:
        return None


@dataclass
class GatedSteps:
    """Device steps whose tokens (step id * 10) come when the test opens the step's gate."""

    stager: PassStager = field(default_factory=PassStager)
    gates: dict[int, threading.Event] = field(default_factory=dict)
    submitted: dict[int, threading.Event] = field(default_factory=dict)  # set when step N was submitted
    waiting: dict[int, threading.Event] = field(default_factory=dict)  # set when a thread waits for step N
    threads: dict[str, set[str]] = field(default_factory=dict)  # what ran on which thread
    spins: list[bool] = field(default_factory=list)  # how each wait for a step's tokens was asked to wait
    hold: threading.Event | None = None  # when set up: waits asked not to spin block until it is set

    def gate(self, step: int) -> threading.Event:
        return self.gates.setdefault(step, threading.Event())

    def _note(self, what: str) -> None:
        self.threads.setdefault(what, set()).add(threading.current_thread().name)

    def submit(self, staged: Staged) -> StepHandle:
        self._note("submit")
        step = staged.fi.step_id
        handle = StepHandle(step, StepKind.decode, staged.fi.num_seqs, 0, GateEvent(self.gate(step)),
                            StepTiming(None, None), False, ())
        self.submitted.setdefault(step, threading.Event()).set()
        return handle

    def wait(self, handle: StepHandle, timeout: float | None = None, *, spin: bool = True) -> None:
        self._note("wait")
        self.spins.append(spin)
        self.waiting.setdefault(handle.step_id, threading.Event()).set()
        if not spin and self.hold is not None:
            assert self.hold.wait(WAIT_S), "the test never let the answering thread's wait go"
        assert handle.event is not None  # submit gives every step its gate
        handle.event.synchronize(timeout)

    def result(self, handle: StepHandle, timeout: float | None = None) -> StepResult:
        self.wait(handle, timeout)
        handle.tokens = [handle.step_id * 10] * handle.num_seqs
        return StepResult(handle.step_id, handle.kind, handle.tokens)


@dataclass
class Kit:
    inputs: Wired
    results: Wired
    steps: GatedSteps
    loop: StepLoop
    thread: threading.Thread
    errors: list[BaseException]

    def send(self, step: int) -> None:
        header = FrameHeader(FrameKind.step, 0, step_id=step, num_seqs=1, bucket=1, kv_blocks=1,
                             sent_at=time.perf_counter(), layout=LAYOUT.encode(), num_tokens=1, max_query_len=1)
        self.inputs.producer.write(header, torch.zeros(LAYOUT.nbytes, dtype=torch.uint8))

    def result(self, step: int) -> list[int]:
        consumer = self.results.consumers[0]
        frame = consumer.read(WAIT_S, who=f"the tokens of step {step}")
        wire_result = decode_result(frame.header, frame.data)
        consumer.release(frame)
        assert wire_result.step_id == step, f"results out of order: step {wire_result.step_id} before {step}"
        return wire_result.tokens

    def stop(self) -> None:
        self.inputs.producer.write(FrameHeader(FrameKind.stop, 0))
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the step loop did not end at the stop frame"
        if self.errors:
            raise self.errors[0]


def kit(spin_us: float, depth: int = 2, inline: bool = True) -> Kit:
    inputs = wire(num_slots=4, slot_bytes=8192, timeout=WAIT_S, spin_us=spin_us)
    results = wire(num_slots=4, slot_bytes=4096, timeout=WAIT_S, spin_us=spin_us)
    steps = GatedSteps()
    loop = StepLoop(inputs.consumers[0], cast(DeviceSteps, steps), results.producer, depth, WAIT_S,
                    inline_answers=inline)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            loop.serve(lambda: MemoryStats(0, 0, 0), lambda kind, text, detail: None)
        except BaseException as error:  # noqa: BLE001 - the test raises it
            errors.append(error)

    thread = threading.Thread(target=serve, name="answering", daemon=True)
    thread.start()
    return Kit(inputs, results, steps, loop, thread, errors)


@pytest.fixture
def kits() -> Iterator[Callable[..., Kit]]:
    made: list[Kit] = []

    def make(**kwargs: float | bool) -> Kit:
        made.append(kit(**kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for k in made:
        for gate in k.steps.gates.values():
            gate.set()
        if k.thread.is_alive():
            k.inputs.producer.write(FrameHeader(FrameKind.stop, 0))
            k.thread.join(WAIT_S)
        k.inputs.close()
        k.results.close()


def wait_for(flag: threading.Event, what: str) -> None:
    assert flag.wait(WAIT_S), what


def test_the_next_frame_is_taken_in_while_a_steps_tokens_are_awaited(kits: Callable[..., Kit]) -> None:
    k = kits(spin_us=50.0)
    k.steps.gate(0)
    k.send(0)
    wait_for(k.steps.waiting.setdefault(0, threading.Event()), "nobody waited for step 0's tokens")
    k.send(1)  # step 0's tokens are still on the "device": a one-thread loop would be stuck in that wait
    wait_for(k.steps.submitted.setdefault(1, threading.Event()),
             "frame 1 was not taken in while the worker waited for step 0's tokens")
    assert not k.results.consumers[0].available(), "step 0 was answered before its tokens came"
    k.steps.gate(0).set()
    assert k.result(0) == [0], "step 0 is answered as soon as its tokens are there, unasked"
    k.steps.gate(1).set()
    assert k.result(1) == [10]
    k.stop()
    assert k.steps.threads["submit"] == {"corelib-receive"}
    assert "answering" in k.steps.threads["wait"], "the answering thread waits for the device"


def test_a_step_done_when_submitted_is_answered_by_the_receiving_thread(kits: Callable[..., Kit]) -> None:
    k = kits(spin_us=50.0)
    for step in range(6):
        k.steps.gate(step).set()  # a device that computes on the host: tokens there at submit
        k.send(step)
        assert k.result(step) == [step * 10]
    k.stop()
    assert k.loop.answered == 6 and k.loop.answered_inline == 6, "a ready step woke the answering thread"


def test_nothing_in_the_hop_sleeps_a_fixed_time(kits: Callable[..., Kit], monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    real_sleep = time.sleep

    def recording_sleep(seconds: float) -> None:
        slept.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", recording_sleep)
    k = kits(spin_us=0.0, inline=False)  # block at once: every wait must be a sleep on a doorbell or an event
    for step in range(8):
        if step % 2:
            k.steps.gate(step).set()
        k.send(step)
        if not step % 2:
            wait_for(k.steps.waiting.setdefault(step, threading.Event()), f"nobody waited for step {step}")
            k.steps.gate(step).set()
        assert k.result(step) == [step * 10]
    # With nothing left to read and no spin, the receiving thread must sleep on its doorbell; how
    # often it did between the frames depends on how the threads were scheduled, so wait for it.
    idle = threading.Event()
    for _ in range(int(WAIT_S / 0.01)):
        if k.loop.consumer.sleeps > 0:
            break
        idle.wait(0.01)  # not time.sleep: that is the function this test records
    k.stop()
    assert slept == [], f"the hop slept fixed times: {slept[:5]}"
    assert k.loop.consumer.sleeps > 0, "the receiving thread never slept on its doorbell"


def test_the_receiving_thread_answers_a_step_while_it_waits_for_the_next_frame(kits: Callable[..., Kit]) -> None:
    """One thread spins: the receiving thread, between frames, spins on the oldest step's event as well and answers
    it; the answering thread waits asleep meanwhile (held here, so only the receiving thread can answer)."""
    held = threading.Event()
    k = kits(spin_us=WAIT_S * 1e6)  # the receiving thread spins the whole test
    k.steps.hold = held
    k.send(0)
    wait_for(k.steps.waiting.setdefault(0, threading.Event()), "nobody waited for step 0's tokens")
    assert k.steps.spins == [False], "the answering thread spins on the event beside the receiving thread"
    k.steps.gate(0).set()
    assert k.result(0) == [0], "step 0's tokens came while the answering thread was held"
    assert k.loop.answered_inline == 1
    held.set()
    k.steps.gate(1).set()
    k.send(1)
    assert k.result(1) == [10]
    k.stop()


def test_where_events_cannot_be_queried_the_answering_thread_spins(kits: Callable[..., Kit]) -> None:
    k = kits(spin_us=50.0, inline=False)
    k.steps.gate(0)
    k.send(0)
    wait_for(k.steps.waiting.setdefault(0, threading.Event()), "nobody waited for step 0's tokens")
    k.steps.gate(0).set()
    assert k.result(0) == [0]
    k.stop()
    assert k.steps.spins[0] is True, "nobody else spins on the step here: the answering thread's wait must"
