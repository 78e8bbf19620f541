"""Doorbells of the SHM ring: wait for a counter in shared memory without pipes or sleep-polling.

A waiter spins for a bounded time (``engine.shm.spin_us``), re-reading its condition and
yielding the GIL every turn; then it announces in its control word that it sleeps, re-checks,
and blocks on its eventfd. A publisher, after storing a counter, writes the waiter's eventfd
only when that word says someone sleeps, so a step whose peer is spinning costs no system call.
A publisher that was idle may ring before it has anything to publish (a heads-up: an engine's
first step after an idle spell is being scheduled and packed); a waiter woken with nothing ready
spins again, for at least :data:`HEADS_UP_SPIN_S`, so that what comes finds it awake.

The announce and re-check are the store-then-load handshake that store buffers break even on
x86-64: without a barrier the waiter may miss the publisher's counter while the publisher
misses the announcement. The waiter, between the two, runs ``membarrier(2)`` with
MEMBARRIER_CMD_GLOBAL_EXPEDITED: every CPU running a thread of a registered process (both
ends register when they map the ring) executes a full barrier before the call returns. Either
the publisher's counter store is then visible to the re-check, or the publisher's later load
of the word sees the announcement. The publisher pays nothing on its fast path.

Where membarrier is unavailable (an old kernel, a seccomp filter) the ring is marked ALWAYS
and every publication writes the eventfd: the waiter drains its eventfd before it re-checks,
and the eventfd's lock in the kernel orders the publisher's counter store before that drain.

Every blocking wait is bounded: it wakes at least every :data:`CHECK_S` seconds, and at once
when a watched descriptor becomes readable (a worker's control pipe, which also shows its
exit), to ask whether the peer is still alive.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import platform
import select
import time
from collections.abc import Callable, Sequence

from corelib.errors import TransportError, WorkerDied

CHECK_S = 0.25  # longest blocking wait between two liveness checks
HOST_SPIN_US = 150.0  # the most a waiting end spins where the host's cores compute the step
# How long a waiter spins after a heads-up (a ring with nothing published): the publisher was idle and is preparing
# what it publishes next (an engine's first step after an idle spell: scheduled, packed), so no step is running
# whose cores the spin could take, and the wait ends as soon as that comes.
HEADS_UP_SPIN_S = 2e-3
_MACHINE = platform.machine().lower()
# x86-64 keeps stores in program order for other CPUs (TSO) and never reorders a load with an
# older load: a frame written before its counter is seen whole once the counter is seen.
STORES_IN_ORDER = _MACHINE in ("x86_64", "amd64", "i386", "i686")
_SYS_MEMBARRIER = {"x86_64": 324, "amd64": 324, "aarch64": 283, "arm64": 283, "riscv64": 283, "loongarch64": 283,
                   "ppc64le": 365, "ppc64": 365, "s390x": 356, "i386": 375, "i686": 375}
_CMD_QUERY, _CMD_GLOBAL_EXPEDITED, _CMD_REGISTER_GLOBAL_EXPEDITED = 0, 1 << 1, 1 << 2


class _Membarrier:
    """membarrier(2) through libc's syscall(); registered once per process."""

    def __init__(self) -> None:
        self.reason = ""
        self._call: Callable[[], int] | None = None
        self._pid = -1

    def _load(self) -> None:
        number = _SYS_MEMBARRIER.get(_MACHINE)
        if number is None:
            self.reason = f"no membarrier syscall number known for {_MACHINE}"
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
        except OSError as error:
            self.reason = f"libc cannot be loaded: {error}"
            return
        syscall = libc.syscall
        supported = syscall(number, _CMD_QUERY, 0, 0)
        wanted = _CMD_GLOBAL_EXPEDITED | _CMD_REGISTER_GLOBAL_EXPEDITED
        if supported < 0 or supported & wanted != wanted:
            self.reason = f"membarrier: {os.strerror(ctypes.get_errno()) if supported < 0 else 'no expedited global'}"
            return
        if syscall(number, _CMD_REGISTER_GLOBAL_EXPEDITED, 0, 0) != 0:
            self.reason = f"membarrier registration: {os.strerror(ctypes.get_errno())}"
            return
        self._call = lambda: int(syscall(number, _CMD_GLOBAL_EXPEDITED, 0, 0))

    def register(self) -> bool:
        """Make this process a target of the barrier (once per process); False where it is unavailable."""
        if self._pid != os.getpid():  # registration does not survive fork
            self._pid = os.getpid()
            self._call = None
            self._load()
        return self._call is not None

    def __call__(self) -> None:
        if self._call is not None and self._call() != 0:
            raise OSError(ctypes.get_errno(), f"membarrier: {os.strerror(ctypes.get_errno())}")


membarrier = _Membarrier()


def register() -> bool:
    """Register this process for the waiters' barrier; False: publishers must signal every time.

    On a CPU that may reorder stores (not x86-64), the barrier also orders a frame before its
    counter, so there the ring cannot work without it and refuses to start.
    """
    if membarrier.register():
        return True
    if not STORES_IN_ORDER:
        raise TransportError(
            f"engine.transport=shm on {_MACHINE} needs membarrier(2) (Linux 4.16 or later) to order shared-memory "
            f"writes, and it is unavailable here ({membarrier.reason}); use engine.transport=inproc"
        )
    return False


def spin_for(spin_us: float, on_host: bool) -> float:
    """The microseconds a waiting end spins: ``engine.shm.spin_us``, at most :data:`HOST_SPIN_US` where the host's
    cores compute the step (``DeviceSpec.on_host``), since a spinning end takes a core from them. Elsewhere a spin
    that outlasts a step's interval keeps the waiter off its eventfd, whose wake-up (tens to hundreds of
    microseconds) would be on every step's path."""
    return min(spin_us, HOST_SPIN_US) if on_host else spin_us


def publish_fence() -> None:
    """Before storing a counter that publishes earlier writes (or ends earlier reads): a full barrier
    where the CPU may reorder them; nothing on x86-64, whose stores and loads keep that order."""
    if not STORES_IN_ORDER:
        membarrier()


def drain(fd: int) -> None:
    """Reset an eventfd to zero (non-blocking)."""
    with contextlib.suppress(BlockingIOError):
        os.eventfd_read(fd)


def new_eventfd() -> int:
    """A non-blocking eventfd; its descriptor is made inheritable only where it is passed to a child."""
    return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


class Bell:
    """The publishing side of a doorbell: rings the peer's eventfd when its control word says it sleeps."""

    def __init__(self, fd: int, words: memoryview, asleep: int, always: int) -> None:
        self.fd = fd
        self._words = words
        self._asleep = asleep
        self._always = always

    def ring(self) -> None:
        words = self._words
        if words[self._asleep] or words[self._always]:
            os.eventfd_write(self.fd, 1)


def explain(alive: Callable[[], str | None], fallback: str, grace: float = 2.0) -> str:
    """Why the peer is gone: a closed descriptor shows before the exit status, so ask again briefly."""
    deadline = time.monotonic() + grace
    while True:
        reason = alive()
        if reason is not None:
            return reason
        if time.monotonic() >= deadline:
            return fallback
        time.sleep(0.01)


class Waiter:
    """The waiting side of a doorbell: spin, then announce, re-check and block on the eventfd."""

    def __init__(
        self,
        fd: int,
        words: memoryview,
        asleep: int,
        spin_us: float,
        alive: Callable[[], str | None],
        watch: Sequence[int] = (),
        peer: str = "the peer",
        heads_up_spin_s: float = HEADS_UP_SPIN_S,
    ) -> None:
        self.fd = fd
        self._words = words
        self._asleep = asleep
        self._spin_s = max(0.0, spin_us) * 1e-6
        # After a heads-up, at least HEADS_UP_SPIN_S; a waiter told never to spin (spin_us 0) does not.
        self._heads_up_spin_s = max(self._spin_s, heads_up_spin_s) if self._spin_s > 0 else 0.0
        self._alive = alive
        self._peer = peer
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)
        self._watch = set(watch)
        for other in self._watch:
            self._poller.register(other, select.POLLIN)
        self.sleeps = 0  # blocking waits so far (a spin that sufficed is not one)

    def wait(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Until ``ready()`` (True) or ``timeout`` seconds (False); raises WorkerDied when the peer is gone.

        A ring of the doorbell that finds nothing ready is the publisher's heads-up (``Bell.ring`` without a
        publication: what it publishes comes soon), so the waiter spins again before it sleeps: it is awake when
        that comes, instead of paying the eventfd's wake-up then."""
        if ready():
            return True
        deadline = time.monotonic() + timeout
        words, asleep, fd = self._words, self._asleep, self.fd
        spin = self._spin_s
        while True:
            if spin and self._spin(ready, spin):
                return True
            words[asleep] = 1
            membarrier()
            drain(fd)
            if ready():
                words[asleep] = 0
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                words[asleep] = 0
                return False
            self.sleeps += 1
            events = self._poller.poll(math.ceil(min(left, CHECK_S) * 1000))
            words[asleep] = 0
            if ready():
                return True
            spin = self._heads_up_spin_s if any(event_fd == fd for event_fd, _ in events) else 0.0
            if not events or any(event_fd in self._watch for event_fd, _ in events):
                self._check(hung_up=any(event_fd in self._watch and mask & (select.POLLHUP | select.POLLERR)
                                        for event_fd, mask in events))

    @staticmethod
    def _spin(ready: Callable[[], bool], seconds: float) -> bool:
        """Re-check ``ready()`` for ``seconds``, yielding the GIL every turn: whether it came."""
        clock = time.perf_counter
        spin_end = clock() + seconds
        while clock() < spin_end:
            os.sched_yield()  # the GIL is released across the call: other threads of this process run
            if ready():
                return True
        return False

    def _check(self, hung_up: bool) -> None:
        reason = self._alive()
        if reason is None and hung_up:
            reason = explain(self._alive, f"{self._peer} closed its end")
        if reason is not None:
            raise WorkerDied(reason)
