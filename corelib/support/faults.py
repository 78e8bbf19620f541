"""Fault injection, a test facility: named points in the engine that raise or stall on demand.

``CORELIB_FAULTS`` lists the points to trigger, comma-separated, each ``POINT[@N][:ACTION]``:

- ``POINT``: ``forward`` (a step's device work), ``capture`` (graph capture), ``submit`` (the
  submission thread), ``poll`` (a worker's polling thread, after it read a frame), ``pack``
  (one request's values written into a step's inputs: ``pack@N`` fails the N-th request packed),
  ``render`` (the server's chat template, sent to its renderer and not answered yet);
- ``@N``: trigger on the N-th time this process reaches the point (default 1);
- ``ACTION``: ``raise`` (default: :class:`InjectedFault`), ``stall[=SECONDS]`` (sleep there,
  an hour by default: a hung kernel, or a consumer that stops consuming) or ``hold`` (the
  gate of another process: wait there until the file named by ``CORELIB_FAULTS_RELEASE``
  exists, after creating that name plus ``.held`` to say so; InjectedFault after an hour).

Example: ``CORELIB_FAULTS=forward@20 python -m corelib run backend=npu``. Worker processes
inherit the variable, so a point inside a worker is reached there.

The variable is read once, when this module is first imported; tests in one process use
:func:`injected` instead, and :func:`gate` to hold a point until the test lets it go (so a test
can act while a step is known to be in progress, whatever the machine's speed); ``hold`` does
the same for a process the test started. Unset, a hook costs one call and one truth test.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

ENV = "CORELIB_FAULTS"
RELEASE_ENV = "CORELIB_FAULTS_RELEASE"  # hold: the file whose existence releases the held point
POINTS = frozenset({"forward", "capture", "submit", "poll", "pack", "render"})
DEFAULT_STALL_S = 3600.0
_SPEC = re.compile(
    r"^(?P<point>[a-z_]+)(?:@(?P<hit>\d+))?(?::(?P<action>raise|stall|hold)(?:=(?P<seconds>[0-9.]+))?)?$"
)


class InjectedFault(RuntimeError):
    """Raised at a point armed by ``CORELIB_FAULTS``; stands for any failure at that point."""


@dataclass(frozen=True)
class Fault:
    point: str
    hit: int = 1  # the N-th arrival at the point triggers
    stall_s: float | None = None  # None: raise (or hold)
    hold: bool = False  # wait for the release file (RELEASE_ENV)


def parse(spec: str) -> dict[str, Fault]:
    """The faults of a ``CORELIB_FAULTS`` value, by point; a malformed entry raises ValueError."""
    faults: dict[str, Fault] = {}
    for entry in (part.strip() for part in spec.split(",")):
        if not entry:
            continue
        match = _SPEC.match(entry)
        if match is None or match["point"] not in POINTS:
            raise ValueError(
                f"{ENV}: cannot read {entry!r}; expected POINT[@N][:raise|:stall[=SECONDS]|:hold] with POINT one "
                f"of {', '.join(sorted(POINTS))}"
            )
        hit = int(match["hit"] or 1)
        if hit < 1:
            raise ValueError(f"{ENV}: {entry!r}: @N counts from 1")
        stall = None
        if match["action"] == "stall":
            stall = float(match["seconds"]) if match["seconds"] else DEFAULT_STALL_S
        hold = match["action"] == "hold"
        if hold and match["seconds"]:
            raise ValueError(f"{ENV}: {entry!r}: hold waits for the file named by {RELEASE_ENV}, not for seconds")
        faults[match["point"]] = Fault(match["point"], hit, stall, hold)
    return faults


class Gate:
    """A point held at its N-th arrival until the test releases it (see :func:`gate`)."""

    def __init__(self, point: str, hit: int, timeout_s: float) -> None:
        self.point = point
        self.hit = hit
        self.timeout_s = timeout_s
        self.reached = threading.Event()  # set when the held arrival is waiting
        self._released = threading.Event()
        self._arrivals = 0

    def release(self) -> None:
        self._released.set()

    def _arrive(self) -> None:
        with _lock:
            self._arrivals += 1
            held = self._arrivals == self.hit
        if not held:
            return
        self.reached.set()
        if not self._released.wait(self.timeout_s):
            raise InjectedFault(f"the gate at {self.point!r} (arrival {self.hit}) was not released within "
                                f"{self.timeout_s:g} s")


_armed: dict[str, Fault] = parse(os.environ.get(ENV, ""))
_hits: dict[str, int] = {}
_gates: dict[str, Gate] = {}
_lock = threading.Lock()


def maybe_fail(point: str) -> None:
    """Raise or stall here if ``point`` is armed and this is its N-th arrival; else nothing."""
    if _gates:
        held = _gates.get(point)
        if held is not None:
            held._arrive()
    if not _armed:
        return
    fault = _armed.get(point)
    if fault is None:
        return
    with _lock:
        _hits[point] = hit = _hits.get(point, 0) + 1
    if hit != fault.hit:
        return
    if fault.stall_s is not None:
        time.sleep(fault.stall_s)
        return
    if fault.hold:
        _hold(fault, hit)
        return
    raise InjectedFault(f"injected fault at {point!r} (arrival {hit}, {ENV})")


def _hold(fault: Fault, hit: int) -> None:
    """Say the point is held (``<release>.held``), then wait until the release file exists."""
    release = os.environ.get(RELEASE_ENV)
    if not release:
        raise InjectedFault(f"{fault.point!r} is armed to hold, but {RELEASE_ENV} names no release file")
    with open(f"{release}.held", "x"):
        pass
    deadline = time.monotonic() + DEFAULT_STALL_S
    while not os.path.exists(release):
        if time.monotonic() >= deadline:
            raise InjectedFault(f"the hold at {fault.point!r} (arrival {hit}) was not released within "
                                f"{DEFAULT_STALL_S:g} s: no {release}")
        time.sleep(0.01)


@contextmanager
def injected(spec: str) -> Iterator[None]:
    """Arm ``spec`` (``CORELIB_FAULTS`` syntax) in this process for the block; counts start at 0."""
    wanted = parse(spec)
    with _lock:
        saved = dict(_armed)
        _armed.clear()
        _armed.update(wanted)
        _hits.clear()
    try:
        yield
    finally:
        with _lock:
            _armed.clear()
            _armed.update(saved)
            _hits.clear()


@contextmanager
def gate(point: str, hit: int = 1, timeout_s: float = 60.0) -> Iterator[Gate]:
    """Hold the ``hit``-th arrival at ``point`` in this process until ``release()`` (or ``timeout_s``, then raise).

    ``reached`` tells the test the arrival is held; leaving the block releases it.
    """
    if point not in POINTS:
        raise ValueError(f"no fault point {point!r}; the points are {', '.join(sorted(POINTS))}")
    held = Gate(point, hit, timeout_s)
    with _lock:
        if point in _gates:
            raise RuntimeError(f"the point {point!r} is already gated")
        _gates[point] = held
    try:
        yield held
    finally:
        held.release()
        with _lock:
            _gates.pop(point, None)
