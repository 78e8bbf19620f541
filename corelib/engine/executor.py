"""Where steps run: on this process's device (in-process), or in worker processes over SHM.

The engine core only packs inputs and calls ``submit``; it reads results in submission order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future

from corelib.device import MemoryStats
from corelib.engine.forward_input import ForwardInput
from corelib.engine.handoff import SubmissionThread
from corelib.engine.metrics import StepResult
from corelib.engine.runner import ModelRunner, StepHandle
from corelib.engine.trace import Tracer
from corelib.errors import DeviceTimeout


class StepFuture(ABC):
    """One submitted step; ``result`` blocks (bounded, without the GIL) for its tokens."""

    @abstractmethod
    def result(self, timeout: float) -> StepResult: ...


class Executor(ABC):
    """Runs packed steps somewhere; results must be read in submission order."""

    #: True when ``submit`` copies the inputs away at once (the host arena is free on return)
    copies_inputs: bool = False

    @abstractmethod
    def submit(self, fi: ForwardInput) -> StepFuture: ...

    @abstractmethod
    def close(self, timeout: float) -> None: ...

    @abstractmethod
    def memory_stats(self) -> list[MemoryStats]:
        """What each device of this executor holds, one entry per rank."""

    def attach_tracer(self, tracer: Tracer) -> None:
        """Record spans of the threads this executor runs (none by default)."""
        del tracer


class _InprocFuture(StepFuture):
    def __init__(self, runner: ModelRunner, submitted: Future[StepHandle]) -> None:
        self._runner = runner
        self._submitted = submitted

    def result(self, timeout: float) -> StepResult:
        try:
            handle = self._submitted.result(timeout)  # re-raises a submission error with its traceback
        except TimeoutError:
            raise DeviceTimeout(f"the submission thread did not submit a step within {timeout:g} s") from None
        return self._runner.result(handle, timeout)


class InprocExecutor(Executor):
    """The device of this process; with async handoff, steps are launched by a submission thread."""

    def __init__(self, runner: ModelRunner, submission_thread: bool) -> None:
        self.runner = runner
        self.submitter = SubmissionThread(runner) if submission_thread else None

    def submit(self, fi: ForwardInput) -> StepFuture:
        if self.submitter is not None:
            return _InprocFuture(self.runner, self.submitter.submit(fi))
        done: Future[StepHandle] = Future()
        done.set_result(self.runner.submit(fi))
        return _InprocFuture(self.runner, done)

    def attach_tracer(self, tracer: Tracer) -> None:
        if self.submitter is not None:
            self.submitter.tracer = tracer

    def memory_stats(self) -> list[MemoryStats]:
        return [self.runner.device.memory_stats()]

    def close(self, timeout: float) -> None:
        try:
            if self.submitter is not None:
                self.submitter.close(timeout)
        finally:
            self.runner.close()
