"""Inputs stay alive until their step's output event completes; the emulator catches an early free.

The engine normally recycles its pinned input arenas through a pool. Here every step gets a
fresh arena that nothing else references, so the arena lives exactly as long as the engine
keeps the step's inputs: correct code keeps them until the tokens are read, the mutation
drops them right after submission, which a DMA-like copy then reads after they were freed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from support import EngineFactory

from corelib.engine import SamplingParams
from corelib.errors import DeviceError
from corelib.step.arena import ArenaPool
from corelib.step.handoff import StepHandle

OVERRIDES = [
    "backend=npu", "backend.emulator.chaos=0.3", "backend.emulator.chaos_max_ms=1", "engine.async_token_handoff=on"
]


@pytest.fixture
def fresh_arenas(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def acquire(self: ArenaPool) -> torch.Tensor:
        return torch.empty(self.nbytes, dtype=torch.uint8)  # pageable: the npu profile reads it late

    monkeypatch.setattr(ArenaPool, "acquire", acquire)
    monkeypatch.setattr(ArenaPool, "release", lambda self, arena: None)
    yield


def generate(make_engine: EngineFactory) -> list[list[int]]:
    engine = make_engine(OVERRIDES)
    prompts = [[i + 2, i + 3, i + 4] for i in range(6)]
    return [o.output_token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))]


def test_inputs_kept_until_the_event_complete_fine(make_engine: EngineFactory, fresh_arenas: None) -> None:
    outputs = generate(make_engine)
    assert all(len(o) == 24 for o in outputs)


def test_freeing_inputs_at_submission_is_caught(
    make_engine: EngineFactory, fresh_arenas: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = StepHandle.__init__

    def forgetful(self: StepHandle, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[arg-type]
        # the mutation: the step's inputs are dropped as soon as the step is queued
        self.keepalive = None
        self.on_done = None

    monkeypatch.setattr(StepHandle, "__init__", forgetful)
    with pytest.raises(DeviceError, match="freed before its copy ran"):
        generate(make_engine)
