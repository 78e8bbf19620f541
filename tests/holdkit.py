"""Device work that stays on its stream until the test lets it go: ordering without timing.

A test launches a :class:`Hold` where it once launched a sleep: the stream is then known to be
busy while the host acts, however fast or loaded the machine is, and the test decides when the
work ends. A hold that is never released ends by itself after ``timeout_s`` (``expired`` says
so), so a broken ordering fails a test instead of hanging it.
"""

from __future__ import annotations

import threading


class Hold:
    """A closure to launch on a stream: it blocks its stream from when it runs until :meth:`release`."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self.running = threading.Event()  # set once the stream reached the hold
        self.expired = False  # the hold ended by its timeout, not by release()
        self._released = threading.Event()

    def __call__(self) -> None:
        self.running.set()
        self.expired = not self._released.wait(self.timeout_s)

    def release(self) -> None:
        self._released.set()
