"""The step pipeline: the one place that knows how many steps may be in flight.

``depth`` steps may be on the device at once: 1 is the synchronous path (each step's tokens
are read before the next step is scheduled); 2 lets the scheduler run one step ahead (async
token handoff), 3 two steps ahead. The token handoff keeps one buffer per step in flight.
The scheduler side and the SHM worker use the same class with the same depth.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class StepPipeline(Generic[T]):
    """Steps submitted and not yet read, oldest first."""

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"a step pipeline holds at least one step, got depth {depth}")
        self.depth = depth
        self._steps: deque[T] = deque()

    @property
    def run_ahead(self) -> int:
        """Steps the host may have submitted beyond the one it reads next."""
        return self.depth - 1

    def __len__(self) -> int:
        return len(self._steps)

    def __bool__(self) -> bool:
        return bool(self._steps)

    def __iter__(self) -> Iterator[T]:
        """Oldest first."""
        return iter(self._steps)

    def can_submit(self) -> bool:
        return len(self._steps) < self.depth

    def must_read(self) -> bool:
        """After a submission: the oldest step must be read before the host schedules again."""
        return len(self._steps) > self.run_ahead

    def push(self, step: T) -> None:
        if not self.can_submit():
            raise RuntimeError(f"the step pipeline is full ({self.depth} in flight): read the oldest step first")
        self._steps.append(step)

    def oldest(self) -> T:
        return self._steps[0]

    def pop(self) -> T:
        return self._steps.popleft()
