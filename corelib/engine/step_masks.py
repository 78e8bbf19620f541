"""A step's grammar masks, owed to a step queued before them: made, computed, finished.

With ``structured_overlap`` a step holding a grammar's row is queued before the previous step's
tokens are read. Once they are (each grammar has taken its token), the loop makes the step's
:class:`StepMasks` and the :class:`MaskThread` computes the grammars' rows (llguidance's thread
pool, without the GIL) while the loop schedules and packs the next step; the loop then finishes
them (the string bounds counted beside the grammar) and queues the step's sampling.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from corelib.engine.scheduler import ScheduledStep
from corelib.engine.sequence import Sequence
from corelib.engine.structured import compute_rows
from corelib.ops.token_mask import ALL_ALLOWED


class MaskThread:
    """The thread a step's grammar masks are computed on while the loop schedules and packs the next step: one
    job at a time. A job that gives up the GIL at once (llguidance's pool does) runs beside the loop's Python:
    ``start`` returns once the job has begun, since a thread that waits for the GIL would otherwise start only
    when the loop next blocks. ``close`` stops the thread (bounded)."""

    NAME = "corelib-grammar-masks"

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=self.NAME)
        self._last: Future[None] | None = None

    def start(self, job: Callable[[], None], timeout: float, what: str) -> Future[None]:
        """Run ``job`` (``what``, for an error) on the thread; returns once it began."""
        began = threading.Event()

        def run() -> None:
            began.set()
            job()

        future = self._pool.submit(run)
        self._last = future
        if not began.wait(timeout):
            raise TimeoutError(f"{what}: the {self.NAME} thread did not take the job within {timeout:g} s")
        return future

    def result(self, future: Future[None], timeout: float, what: str) -> None:
        """Wait for ``future`` (its error raised here); TimeoutError naming ``what`` and the thread past ``timeout``."""
        try:
            future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{what} were not written within {timeout:g} s (thread {self.NAME})") from None

    def close(self, timeout: float) -> None:
        """Stop the thread once its job (if any) is done: TimeoutError when that job outlasts ``timeout``."""
        last = self._last
        if last is not None:
            concurrent.futures.wait([last], timeout)
        finished = last is None or last.done()
        self._pool.shutdown(wait=finished, cancel_futures=True)
        if not finished:
            raise TimeoutError(f"the {self.NAME} thread's job did not end within {timeout:g} s")


class StepMasks:
    """A step's token bitmask (``masks`` [rows, words] int32; ``out``, the same memory as the device's copy reads
    it) in three parts. Made: the rows without a grammar allow every token. ``compute``: the grammars' rows,
    written by llguidance's thread pool without the GIL, on any thread (the loop's or the mask thread).
    ``finish``, on the loop's thread: the tokens each schema's counted string bounds forbid taken out. A failure
    of the pool is found in ``finish`` by filling the rows one by one, and told to the request whose grammar
    failed (the error ``failed`` makes of it: the packer's PackingError)."""

    def __init__(self, step: ScheduledStep, rows: list[int], masks: npt.NDArray[Any], out: torch.Tensor,
                 failed: Callable[[Sequence, Exception], Exception]) -> None:
        self._step, self._masks, self.out, self._failed_as = step, masks, out, failed
        self._states = [(grammar, row) for row in rows if (grammar := step.seqs[row].grammar) is not None]
        self._pool_failed = False
        if len(self._states) < masks.shape[0]:  # a grammar writes its whole row: only the others are set here
            others = np.ones(masks.shape[0], dtype=bool)
            others[[row for _, row in self._states]] = False
            masks[others] = ALL_ALLOWED

    def compute(self) -> None:
        try:
            compute_rows(self._states, self._masks.ctypes.data, self._masks.strides[0], self._masks.shape[0])
        except Exception:  # noqa: BLE001 - whose it is shows in finish
            self._pool_failed = True

    def finish(self) -> torch.Tensor:
        """The step's rows for the device (``out``); raises what ``failed`` makes of a request's grammar failing."""
        masks, failed = self._masks, self._pool_failed
        # Rows the pool wrote lose what their counted strings' bounds forbid (most schemas count none).
        rows = self._states if failed else [entry for entry in self._states if entry[0].counts_bounds]
        words = masks.view(np.uint32) if rows else masks
        for grammar, row in rows:
            try:
                if failed:
                    grammar.fill(masks[row].ctypes.data, masks[row].nbytes)
                else:
                    grammar.restrict(words[row])
            except Exception as error:  # whatever it is, it is this request's
                raise self._failed_as(self._step.seqs[row], error) from error
        return self.out
