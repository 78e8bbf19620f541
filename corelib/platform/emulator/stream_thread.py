"""One emulated hardware queue: a thread that runs operations in FIFO order.

A worker never polls: it sleeps on a condition until work arrives. An exception raised by an
operation poisons the worker: queued and later operations are dropped and every event
recorded behind the failure fails with a DeviceError whose cause is the original exception.
"""

from __future__ import annotations

import random
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable

from corelib.config.schema import EmulatorConfig
from corelib.errors import DeviceError, one_line


class Marker:
    """One record of an event. It completes when its worker reaches it, or fails with the worker."""

    __slots__ = ("_cause", "_message", "done", "event_name", "stream_name", "time")

    def __init__(self, event_name: str, stream_name: str) -> None:
        self.event_name = event_name
        self.stream_name = stream_name
        self.done = threading.Event()
        self.time: float | None = None
        self._message: str | None = None
        self._cause: BaseException | None = None

    def complete(self) -> None:
        self.time = time.perf_counter()
        self.done.set()

    def fail(self, message: str, cause: BaseException) -> None:
        self._message = (
            f"event {self.event_name!r} on stream {self.stream_name!r} will never complete: {message}"
        )
        self._cause = cause
        self.done.set()

    @property
    def failed(self) -> bool:
        return self._cause is not None

    def raise_if_failed(self) -> None:
        if self._cause is not None:
            # A fresh error per waiter: re-raising one object from several threads would
            # splice their tracebacks together. The original keeps its own traceback.
            raise DeviceError(self._message) from self._cause


class Op(ABC):
    """An operation queued on a worker."""

    @abstractmethod
    def run(self, worker: StreamThread) -> None: ...

    @abstractmethod
    def describe(self) -> str: ...

    def cancel(self, message: str, cause: BaseException) -> None:
        """The operation will never run (its stream failed or closed)."""
        return None

    @property
    def is_launch(self) -> bool:
        return False


class RecordOp(Op):
    def __init__(self, marker: Marker) -> None:
        self.marker = marker

    def run(self, worker: StreamThread) -> None:
        self.marker.complete()

    def describe(self) -> str:
        return f"record of event {self.marker.event_name!r}"

    def cancel(self, message: str, cause: BaseException) -> None:
        self.marker.fail(message, cause)


class Pacer:
    """Chaos delays and the cost model, drawn from a per-stream seeded generator."""

    def __init__(self, config: EmulatorConfig, stream_key: str) -> None:
        self._chaos = float(config.chaos)
        self._chaos_max_s = float(config.chaos_max_ms) / 1e3
        self._launch_s = float(config.launch_latency_us) / 1e6
        self._bytes_per_s = float(config.copy_gb_per_s) * 1e9
        # A string seed is hashed deterministically (unlike hash()), so runs reproduce.
        self._rng = random.Random(f"{config.seed}:{stream_key}")

    def before(self, op: Op) -> None:
        if self._chaos > 0.0 and self._rng.random() < self._chaos:
            # uniform in (0, max]: 1 - random() is never 0
            time.sleep(self._chaos_max_s * (1.0 - self._rng.random()))
        if op.is_launch and self._launch_s > 0.0:
            time.sleep(self._launch_s)

    def copy_seconds(self, nbytes: int) -> float:
        return nbytes / self._bytes_per_s if self._bytes_per_s > 0.0 else 0.0


class StreamThread:
    """A thread with a FIFO queue: the emulation of one hardware stream."""

    def __init__(
        self, device_name: str, name: str, config: EmulatorConfig, timeout_s: float, label: str
    ) -> None:
        self.device_name = device_name
        self.name = name
        self.timeout_s = timeout_s
        self.pacer = Pacer(config, name)
        self._cond = threading.Condition()
        self._queue: deque[Op] = deque()
        self._stopping = False
        self._failure: tuple[str, BaseException] | None = None
        self._running: Op | None = None
        # daemon only so that a device never closed cannot hang interpreter exit;
        # close() still joins every worker.
        self._thread = threading.Thread(target=self._loop, name=f"corelib-emu-{label}-{name}", daemon=True)
        self._thread.start()

    def submit(self, ops: Iterable[Op]) -> None:
        """Queue operations in order. On a failed worker they are cancelled at once."""
        with self._cond:
            if self._stopping:
                raise RuntimeError(
                    f"device {self.device_name!r} is closed: stream {self.name!r} takes no work"
                )
            if self._failure is not None:
                message, cause = self._failure
                for op in ops:
                    op.cancel(message, cause)
                return
            self._queue.extend(ops)
            self._cond.notify()

    def running(self) -> str:
        op = self._running
        return op.describe() if op is not None else "nothing"

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Finish the queued work, then exit."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def cancel(self, message: str) -> None:
        """Drop queued work; events recorded behind it fail with ``message``."""
        with self._cond:
            self._stopping = True
            pending = list(self._queue)
            self._queue.clear()
            self._cond.notify()
        cause = RuntimeError(message)
        for op in pending:
            op.cancel(message, cause)

    def join(self, timeout: float) -> bool:
        self._thread.join(max(timeout, 0.0))
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    # Idle is not an error; the timeout only bounds each sleep.
                    self._cond.wait(self.timeout_s)
                if not self._queue:
                    return
                op = self._queue.popleft()
                self._running = op
            try:
                self.pacer.before(op)
                op.run(self)
            except BaseException as error:  # noqa: BLE001 - device work failing must not kill the queue silently
                self._poison(op, error)
            finally:
                self._running = None

    def _poison(self, op: Op, error: BaseException) -> None:
        if isinstance(error, DeviceError):
            message = f"stream {self.name!r}: {error}"
        else:
            message = f"stream {self.name!r} failed in {op.describe()}: {one_line(error)}"
        with self._cond:
            if self._failure is None:
                self._failure = (f"{self.device_name}: {message}", error)
            failure = self._failure
            pending = list(self._queue)
            self._queue.clear()
        for queued in pending:
            queued.cancel(*failure)
