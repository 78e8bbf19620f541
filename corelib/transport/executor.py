"""Where steps run: on this process's device (in-process), or in worker processes over SHM.

The engine core packs a step into a host arena from the executor's arena pool and calls
``submit``; it reads results in submission order. Each transport has a factory in
:data:`corelib.transport.factory.EXECUTORS`, so the engine never branches on the transport itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from corelib.observe.trace import Tracer
from corelib.platform.device import Device, MemoryStats
from corelib.step.arena import ArenaPool, Arenas
from corelib.step.device_steps import DeviceSteps
from corelib.step.forward_input import ForwardInput
from corelib.step.handoff import StepHandle, StepResult
from corelib.step.layout import EngineLayout

if TYPE_CHECKING:
    pass

SPARE_ARENAS = 2  # beyond the pipeline: the step being packed, and room to pack ahead


class StepFuture(ABC):
    """One submitted step; ``result`` blocks (bounded, without the GIL) for its tokens."""

    @abstractmethod
    def result(self, timeout: float) -> StepResult: ...

    def supply_mask(self, masks: torch.Tensor | None) -> None:
        """Queue the sampling of a step submitted before its grammar mask (``ForwardInput.mask_deferred``), through
        ``masks`` [rows, words] int32 in the step's host arena (None: every token allowed). Only an executor whose
        ``defers_masks`` is true is given such steps."""
        raise NotImplementedError(f"{type(self).__name__} runs no step ahead of its grammar mask")


class Executor(ABC):
    """Runs packed steps somewhere; results must be read in submission order."""

    #: host arenas the engine core packs steps into
    arenas: Arenas
    #: user-facing notes from building the executor (said once at start)
    notices: list[str]
    #: the layout the steps run with, its KV pool sized once the model is loaded (None: the one it was given)
    layout: EngineLayout | None = None
    #: steps may be submitted before their grammar mask, which follows through ``StepFuture.supply_mask``
    defers_masks: bool = False

    @abstractmethod
    def submit(self, fi: ForwardInput, release: Callable[[], None]) -> StepFuture:
        """Queue ``fi``; ``release`` is called once the executor no longer reads ``fi.arena``."""

    @abstractmethod
    def close(self, timeout: float) -> None: ...

    @abstractmethod
    def memory_stats(self) -> list[MemoryStats]:
        """What each device of this executor holds, one entry per rank."""

    def wake(self) -> None:
        """A step follows soon, after the engine was idle: what runs it may start waking now, while the step is
        scheduled and packed (nothing by default)."""
        return None

    def check_alive(self) -> None:
        """Raise when what runs the steps is gone, even with no step in flight (nothing to check by default)."""
        return None

    def attach_tracer(self, tracer: Tracer) -> None:
        """Record spans of what this executor runs (nothing by default)."""
        del tracer


class _InprocFuture(StepFuture):
    def __init__(self, steps: DeviceSteps, handle: StepHandle) -> None:
        self._steps = steps
        self._handle = handle

    def result(self, timeout: float) -> StepResult:
        return self._steps.result(self._handle, timeout)

    def supply_mask(self, masks: torch.Tensor | None) -> None:
        self._steps.supply_mask(self._handle, masks)


class InprocExecutor(Executor):
    """The device of this process: steps are launched from the scheduler's own thread."""

    defers_masks = True  # the mask is host memory the scheduler's thread copies, like the step's inputs

    def __init__(self, device: Device, steps: DeviceSteps, arenas: ArenaPool) -> None:
        self.device = device
        self.steps = steps
        self.arenas = arenas
        self.notices = []

    def submit(self, fi: ForwardInput, release: Callable[[], None]) -> StepFuture:
        staged = self.steps.stager.adopt(fi, release)
        try:
            handle = self.steps.submit(staged)
        except BaseException:
            staged.release()
            raise
        return _InprocFuture(self.steps, handle)

    def memory_stats(self) -> list[MemoryStats]:
        return [self.device.memory_stats()]

    def close(self, timeout: float) -> None:
        try:
            self.steps.close()
        finally:
            self.device.close()
