"""Async token handoff plumbing: staging buffers, the submission thread, step futures."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

from corelib import faults
from corelib.engine.forward_input import ForwardInput
from corelib.engine.runner import ModelRunner, StepHandle
from corelib.engine.trace import NULL_TRACER, SUBMISSION_LANE, Tracer
from corelib.errors import DeviceTimeout


class StagingPool:
    """Pinned host arenas reused once the step that read them has completed."""

    def __init__(
        self,
        allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
        nbytes: int,
        count: int,
        timeout_s: float,
    ) -> None:
        self._free: deque[torch.Tensor] = deque(allocate((nbytes,), torch.uint8) for _ in range(count))
        self._cond = threading.Condition()
        self._timeout = timeout_s
        self.nbytes = nbytes

    def acquire(self) -> torch.Tensor:
        deadline = time.monotonic() + self._timeout
        with self._cond:
            while not self._free:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    raise DeviceTimeout(
                        f"no free input staging buffer within {self._timeout:g} s: "
                        "every buffer still belongs to a step whose tokens were not read"
                    )
            return self._free.popleft()

    def release(self, arena: torch.Tensor) -> None:
        with self._cond:
            self._free.append(arena)
            self._cond.notify()


class SubmissionThread:
    """Launches steps on the device from its own thread, in order.

    The scheduler hands over packed inputs and goes on with the previous step's tokens;
    an exception here reaches the caller through the step's future, and stops the thread.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner
        self._queue: queue.SimpleQueue[tuple[ForwardInput, Future[StepHandle]] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self.tracer: Tracer = NULL_TRACER
        self._thread = threading.Thread(target=self._run, name="corelib-submit", daemon=True)
        self._thread.start()

    def submit(self, fi: ForwardInput) -> Future[StepHandle]:
        future: Future[StepHandle] = Future()
        if self._error is not None:
            future.set_exception(RuntimeError(f"the submission thread stopped after an error: {self._error!r}"))
            return future
        self._queue.put((fi, future))
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fi, future = item
            if self._error is not None:
                future.set_exception(RuntimeError(f"the submission thread stopped after an error: {self._error!r}"))
                continue
            try:
                faults.maybe_fail("submit")
                with self.tracer.span("submit", SUBMISSION_LANE, step=fi.step_id):
                    handle = self._runner.submit(fi)
                future.set_result(handle)
            except BaseException as error:  # noqa: BLE001 - handed to the caller with its traceback
                self._error = error
                future.set_exception(error)

    def close(self, timeout: float) -> None:
        """Stop after the queued steps; raise if the thread does not end in time."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise DeviceTimeout(f"the submission thread did not stop within {timeout:g} s")
