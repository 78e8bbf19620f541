"""Commands from the server to its engine process, written in the order they are sent over the command pipe.

The engine process itself (:mod:`corelib.server.engine_process`) reads them on a thread of its own and
hands them to the engine loop between two steps.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import threading

from corelib.server.messages import Command, encode

WRITE_WAIT_S = 0.5  # the writer's thread looks this often whether the pipe is being closed while it waits on it


class CommandWriter:
    """Commands to the engine process, in the order they are sent, over the (non-blocking) command pipe.

    The thread that sends a command writes it at once when nobody else is writing and the pipe
    takes it all: a request from the event loop reaches the engine without waiting for another
    thread to get the GIL, which takes up to the interpreter's switch interval (5 ms) while the
    loop is busy streaming. What the pipe does not take then (the engine reads slowly), or what
    is sent while another thread writes, is written by a thread of its own once the pipe takes
    more. ``send`` never blocks and is safe from any thread and from a signal handler: it queues
    and only tries the lock.
    """

    def __init__(self, fd: int, start: bool = True) -> None:
        self._fd = fd
        os.set_blocking(fd, False)
        self._queue: queue.SimpleQueue[Command | None] = queue.SimpleQueue()  # not taken yet, oldest first
        self._wakeups: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # held by whoever writes; guards what follows
        self._unsent: memoryview | None = None  # the rest of a command the pipe took part of
        self._done = False  # the end was reached, the pipe broke or is closed: nothing more is written
        self._closing = False
        self._thread = threading.Thread(target=self.run, name="corelib-engine-commands", daemon=True)
        if start:
            self._thread.start()

    def send(self, command: Command) -> None:
        """Queue ``command`` and write what is queued, as far as the pipe takes it now."""
        self._queue.put(command)
        if self._lock.acquire(blocking=False):
            try:
                if self._flush(wait=False):
                    return
            finally:
                self._lock.release()
        self._wakeups.put(None)  # the thread writes it once the lock is free and the pipe takes more

    def end(self) -> None:
        """What was sent before is still written; what is sent after is dropped, and the thread stops."""
        self._queue.put(None)
        self._wakeups.put(None)

    def run(self) -> None:
        """The writer's thread: what ``send`` left, waiting until the pipe takes it."""
        while not self._done:
            self._wakeups.get()
            with self._lock:
                self._flush(wait=True)

    def close(self, timeout_s: float) -> None:
        """End, give the thread ``timeout_s`` to write what is queued, then close the pipe."""
        self.end()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._closing = True  # a thread still waiting on the pipe gives up within WRITE_WAIT_S
        with self._lock:
            if self._fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
                self._fd = -1
            self._done = True

    def _flush(self, wait: bool) -> bool:
        """Write what is queued, in order, the lock held; False if the pipe took not all of it and ``wait`` is
        false. With ``wait``, wait until the pipe takes it (or the pipe is being closed)."""
        while not self._done:
            if self._unsent is None:
                try:
                    command = self._queue.get_nowait()
                except queue.Empty:
                    return True
                if command is None:
                    self._done = True
                    break
                self._unsent = memoryview(encode(command))
            try:
                written = os.write(self._fd, self._unsent)
            except BlockingIOError:
                if not wait:
                    return False
                if self._closing:
                    self._done = True
                    break
                with contextlib.suppress(OSError):
                    select.select([], [self._fd], [], WRITE_WAIT_S)
                continue
            except OSError:
                self._done = True  # the engine process is gone: the frame pipe's end-of-file reports it
                break
            self._unsent = self._unsent[written:] if written < len(self._unsent) else None
        return True
