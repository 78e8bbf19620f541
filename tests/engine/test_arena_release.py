"""A step's host arena goes back to the pool only once the device is done with the step, never at submit.

A release spy records every arena given back; the device work of the first step is held at a
gate, and the test looks once the host waits for that step's tokens (so its submission is over)
while the step is known to be on the device, whatever the machine's speed.
"""

from __future__ import annotations

import threading

import pytest
import torch
from support import EngineFactory

from corelib.engine import SamplingParams
from corelib.engine.packing import InputBuilder
from corelib.engine.scheduler import ScheduledStep
from corelib.step.arena import ArenaPool
from corelib.step.device_steps import DeviceSteps
from corelib.step.forward_input import ForwardInput
from corelib.step.handoff import StepHandle, StepResult
from corelib.support import faults


def test_the_arena_of_a_step_on_the_device_is_not_back_in_the_pool(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed: dict[int, int] = {}  # step id -> its arena's address
    released: list[int] = []
    waiting = threading.Event()  # the host waits for a step's tokens: that step's submission returned
    fill, release, result = InputBuilder.fill, ArenaPool.release, DeviceSteps.result

    def spy_fill(self: InputBuilder, step_id: int, step: ScheduledStep, arena: torch.Tensor, bucket: int,
                 kv_blocks: int, padded: int = 0) -> ForwardInput:
        packed[step_id] = arena.data_ptr()
        return fill(self, step_id, step, arena, bucket, kv_blocks, padded)

    def spy_release(self: ArenaPool, arena: torch.Tensor) -> None:
        released.append(arena.data_ptr())
        release(self, arena)

    def spy_result(self: DeviceSteps, handle: StepHandle, timeout: float | None = None) -> StepResult:
        waiting.set()
        return result(self, handle, timeout)

    monkeypatch.setattr(InputBuilder, "fill", spy_fill)
    monkeypatch.setattr(DeviceSteps, "result", spy_result)
    monkeypatch.setattr(ArenaPool, "release", spy_release)
    # The emulator runs device work on a thread of its own: a held forward is a step on the device (the
    # first step's own: with its graph captured first, the held forward would be the capture's warm-up).
    engine = make_engine(["backend=npu", "engine.async_token_handoff=off", "engine.mixed_graphs=off"])
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=2, ignore_eos=True))
    with faults.gate("forward", hit=1) as held:
        driver = threading.Thread(target=engine.step)
        driver.start()
        assert held.reached.wait(60), "the first step never reached the device"
        assert waiting.wait(60), "the host never waited for the first step's tokens"
        first = packed[min(packed)]
        assert first not in released, "the arena went back to the pool while the device still reads the step"
        held.release()
        driver.join(60)
    assert not driver.is_alive()
    assert first in released, "the arena never went back to the pool"
    while engine.has_unfinished:
        engine.step()
    assert sorted(released) == sorted(packed.values()), "every step's arena goes back exactly once"
