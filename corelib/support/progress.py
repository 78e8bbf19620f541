"""What a command shows while it works, on the console and in the log.

Building weights, allocating the KV cache, capturing graphs and decoding can each take a
minute on a CPU. A :class:`Progress` reports them as tasks: a rich bar on a terminal; on a
pipe or a file (CI, ``| tee``) a plain line every ``interval_s`` seconds once a task has run
that long, and one when it ends. Every line shown also goes to the ``corelib`` loggers, so
the run directory's ``run.log`` (Hydra's job log) keeps what the console showed.

Code deep in the engine does not get a reporter passed down through every constructor: it
asks :func:`current` for the one the running command installed with :func:`reporting`.
Outside a command (the Python API) that is a reporter without a console, which only logs.

    with current().task("capturing decode graphs", total=len(shapes), unit="graphs") as task:
        for shape in shapes:
            capture(shape)
            task.advance()
"""

from __future__ import annotations

import contextvars
import io
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from rich.console import Console, RenderableType
from rich.progress import BarColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

log = logging.getLogger("corelib.progress")
console_log = logging.getLogger("corelib.console")

T = TypeVar("T")

INTERVAL_ENV = "CORELIB_PROGRESS_INTERVAL"  # seconds between plain progress lines (default 5)
DEFAULT_INTERVAL_S = 5.0


def default_interval() -> float:
    """``CORELIB_PROGRESS_INTERVAL`` seconds, or 5; a value that is not a number >= 0 counts as unset."""
    try:
        value = float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S))
    except ValueError:
        return DEFAULT_INTERVAL_S
    return value if value >= 0 else DEFAULT_INTERVAL_S


class Task:
    """One long step in progress; ``advance()`` as each unit of it is done."""

    def __init__(self, owner: Progress, name: str, total: int | None, unit: str) -> None:
        self.name = name
        self.total = total
        self.unit = unit
        self.completed = 0
        self.started = owner.clock()
        self.lines_shown = 0  # plain progress lines printed for this task
        self._owner = owner
        self._last_line = self.started
        self._bar: TaskID | None = None  # the rich task id, on a terminal

    def advance(self, amount: int = 1) -> None:
        self.completed += amount
        self._owner._advanced(self, amount)

    def advanced(self, value: T) -> T:
        """``advance()`` and pass ``value`` through: for a loader's ``get`` lambda."""
        self.advance()
        return value

    def count(self) -> str:
        """``12/311 tensors`` (``12 tensors`` when the total is unknown)."""
        done = f"{self.completed}/{self.total}" if self.total is not None else str(self.completed)
        return f"{done} {self.unit}".rstrip()

    def line(self, now: float) -> str:
        share = f" ({100 * self.completed / self.total:.0f} %)" if self.total else ""
        return f"{self.name}: {self.count()}{share}, {now - self.started:.0f} s"


class Progress:
    """Reports tasks to ``console`` (a bar on a terminal, periodic lines elsewhere) and to the log.

    ``console=None`` only logs. ``interval_s`` is the time between plain lines (and between
    the log's lines about one task); ``CORELIB_PROGRESS_INTERVAL`` sets it when not given.
    """

    def __init__(
        self,
        console: Console | None = None,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console = console
        self.interval_s = default_interval() if interval_s is None else interval_s
        self.clock = clock
        self._lock = threading.Lock()
        self._bars: RichProgress | None = None
        self._open = 0

    @property
    def live(self) -> bool:
        """Whether tasks draw a bar (a terminal) rather than print lines."""
        return self.console is not None and self.console.is_terminal

    @contextmanager
    def task(self, name: str, total: int | None = None, unit: str = "") -> Iterator[Task]:
        """A task from entry to exit; the exit says how long it took (or that it stopped)."""
        task = Task(self, name, total, unit)
        log.info("%s: started%s", name, f" ({f'{total} {unit}'.rstrip()})" if total is not None else "")
        self._begin(task)
        ok = False
        try:
            yield task
            ok = True
        finally:
            self._end(task)
            elapsed = self.clock() - task.started
            if ok:
                done = f"{name}: {task.count()} in {elapsed:.1f} s"
                log.info("%s", done)
                if task.lines_shown and not self.live:
                    self._print(done)  # the periodic lines said it was going; say it ended
            else:
                log.info("%s: stopped after %s in %.1f s", name, task.count(), elapsed)

    # ------------------------------------------------------------------ internals
    def _begin(self, task: Task) -> None:
        if not self.live:
            return
        with self._lock:
            if self._bars is None:
                self._bars = RichProgress(
                    TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                    TimeElapsedColumn(), console=self.console, transient=True,
                )
                self._bars.start()
            self._open += 1
            task._bar = self._bars.add_task(task.name, total=task.total, count=task.count())

    def _end(self, task: Task) -> None:
        if task._bar is None:
            return
        with self._lock:
            bars = self._bars
            if bars is None:
                return
            bars.remove_task(task._bar)
            self._open -= 1
            if self._open == 0:
                bars.stop()
                self._bars = None

    def _advanced(self, task: Task, amount: int) -> None:
        bars = self._bars
        if task._bar is not None and bars is not None:
            bars.update(task._bar, advance=amount, count=task.count())
        now = self.clock()
        if now - task._last_line < self.interval_s or (task.total is not None and task.completed >= task.total):
            return  # not yet; or done, which the task's end says
        task._last_line = now
        line = task.line(now)
        log.info("%s", line)
        if self.console is not None and not self.live:
            task.lines_shown += 1
            self._print(line)

    def _print(self, line: str) -> None:
        if self.console is not None:
            self.console.print(f"corelib: {line}", markup=False, highlight=False, soft_wrap=True)


_current: contextvars.ContextVar[Progress | None] = contextvars.ContextVar("corelib_progress", default=None)
_LOG_ONLY = Progress()


def current() -> Progress:
    """The reporter of the running command; outside one, a reporter that only logs."""
    return _current.get() or _LOG_ONLY


@contextmanager
def reporting(progress: Progress) -> Iterator[Progress]:
    """Make ``progress`` the one :func:`current` returns in this thread, until the block ends."""
    token = _current.set(progress)
    try:
        yield progress
    finally:
        _current.reset(token)


def say(console: Console, message: str) -> None:
    """Print ``corelib: message`` and log it."""
    console_log.info("%s", message)
    console.print(f"corelib: {message}", markup=False, highlight=False, soft_wrap=True)


def show(console: Console, renderable: RenderableType) -> None:
    """Print a table (or any renderable) and log its plain text."""
    console.print(renderable)
    plain = Console(file=io.StringIO(), width=160, color_system=None, highlight=False)
    plain.print(renderable)
    file = plain.file
    if isinstance(file, io.StringIO):
        console_log.info("\n%s", file.getvalue().rstrip())
