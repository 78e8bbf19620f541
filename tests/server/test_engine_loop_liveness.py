"""An idle engine loop looks at its engine before it answers a snapshot or takes requests: a worker that went away
while nothing ran is reported then, not found by the next request failing (the periodic check is turned off here)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import pytest

from corelib.engine.sequence import SamplingParams
from corelib.errors import WorkerDied
from corelib.server import engine_loop
from corelib.server.engine_loop import EngineLoop
from corelib.server.fake import FakeEngine, FakeSpec
from corelib.server.messages import Ask, Command, Frame, SnapshotFrame, StepFrame, Stop, Submit

GONE = "worker rank 0 (pid 4242) was killed by SIGKILL"


class Dying(FakeEngine):
    """The stand-in, whose worker can be made to go away."""

    gone = False

    def check_alive(self) -> None:
        if self.gone:
            raise WorkerDied(GONE)


class Loop:
    """An engine loop on a thread, its frames, and a way to wait for the next one."""

    def __init__(self) -> None:
        self.engine = Dying(FakeSpec(step_ms=0.1))
        self.inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.frames: queue.SimpleQueue[Frame] = queue.SimpleQueue()
        self.thread = threading.Thread(target=EngineLoop(self.engine, self.inbox, self.frames.put).run, daemon=True)
        self.thread.start()

    def until(self, kind: type[Frame]) -> list[Frame]:
        """Every frame up to and including the first of ``kind``."""
        seen: list[Frame] = []
        while not seen or not isinstance(seen[-1], kind):
            seen.append(self.frames.get(timeout=30))
        return seen


@pytest.fixture
def loop(monkeypatch: pytest.MonkeyPatch) -> Iterator[Loop]:
    monkeypatch.setattr(engine_loop, "IDLE_CHECK_S", 3600.0)  # only the checks under test can find the death
    running = Loop()
    yield running
    running.inbox.put(Stop("the server is shutting down"))
    running.thread.join(30)
    assert not running.thread.is_alive()


def test_an_idle_engine_reports_a_dead_worker_before_it_answers_a_snapshot(loop: Loop) -> None:
    loop.inbox.put(Ask(1))
    [answer] = loop.until(SnapshotFrame)
    assert isinstance(answer, SnapshotFrame) and answer.snapshot.failure is None
    loop.engine.gone = True
    loop.inbox.put(Ask(2))
    *before, answer = loop.until(SnapshotFrame)
    assert [frame.failure for frame in before if isinstance(frame, StepFrame)] == [f"WorkerDied: {GONE}"]
    assert isinstance(answer, SnapshotFrame) and answer.snapshot.failure == f"WorkerDied: {GONE}"


def test_a_request_to_an_idle_engine_whose_worker_died_is_refused_as_unavailable(loop: Loop) -> None:
    loop.engine.gone = True
    loop.inbox.put(Submit([("late", [1, 2], SamplingParams(max_tokens=3))], final_only=True))
    loop.inbox.put(Ask(1))
    frames = loop.until(SnapshotFrame)
    finals = [final for frame in frames if isinstance(frame, StepFrame) for final in frame.finals]
    assert [(f.request_id, f.output, f.server_error) for f in finals] == [("late", None, False)]
    assert finals[0].ended_by is not None and GONE in finals[0].ended_by
    assert not loop.engine.has_unfinished, "the request reached the engine"
