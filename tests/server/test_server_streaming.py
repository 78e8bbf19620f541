"""The pieces of the streaming path, without a server: frames across a pipe, events from updates, the stand-in."""

from __future__ import annotations

import json
import queue
import threading
import time

import pytest

from corelib.engine.outputs import RequestOutput
from corelib.engine.sequence import SamplingParams
from corelib.engine.streaming import DeltaTracker
from corelib.errors import WorkerDied
from corelib.server.engine_loop import EngineLoop
from corelib.server.fake import FakeEngine, FakeSpec
from corelib.server.inputs import Prepared
from corelib.server.messages import Abort, Command, Decoder, Final, Frame, StepFrame, Stop, Submit, encode
from corelib.server.responses import Formatter


def test_messages_survive_a_pipe_that_cuts_them_anywhere() -> None:
    sent: list[Command | Frame] = [
        StepFrame([("req-1", [5, 6], "ab"), ("req-2", [7], "")], []),
        Submit([("req-3", [1, 2, 3], SamplingParams(max_tokens=4, seed=9))], final_only=True),
        StepFrame([], [Final("req-1", [8], "c", RequestOutput("req-1", [1], [5, 6, 8], "length"))], "boom"),
        Abort(["req-2"]),
    ]
    data = b"".join(encode(message) for message in sent)
    for piece in (1, 3, 7, len(data)):
        decoder = Decoder()
        got: list[object] = []
        for start in range(0, len(data), piece):
            got += decoder.feed(data[start : start + piece])
        assert got == sent, f"pieces of {piece} bytes"
        assert not decoder.partial


def formatter(num_choices: int = 1, chat: bool = False) -> tuple[Formatter, list[str]]:
    ids = [f"req-{i}" for i in range(num_choices)]
    prepared = Prepared([[1, 2]], [([1, 2], SamplingParams()) for _ in ids])
    result = Formatter(chat, "m", prepared, has_tokenizer=False, include_usage=True)
    result.start(ids)
    return result, ids


def payloads(data: bytes) -> list[str]:
    return [line[len("data: "):] for line in data.decode().split("\n") if line.startswith("data: ")]


def final(request_id: str, new: list[int], all_tokens: list[int]) -> Final:
    return Final(request_id, new, "", RequestOutput(request_id, [1, 2], all_tokens, "length"))


def test_the_tokens_of_several_steps_leave_as_one_event_per_choice() -> None:
    fmt, (a, b) = formatter(2)
    data, done = fmt.events([(a, [5], ""), (b, [9], ""), (a, [6], ""), (a, [7], "")])
    events = [json.loads(p)["choices"][0] for p in payloads(data)]
    assert not done
    assert [(e["index"], e["text"]) for e in events] == [(0, "<5><6><7>"), (1, "<9>")]


def test_the_last_event_carries_the_text_that_came_with_it_then_usage_and_done() -> None:
    fmt, (a,) = formatter(1)
    data, done = fmt.events([(a, [5], "")])
    assert not done and [json.loads(p)["choices"][0]["text"] for p in payloads(data)] == ["<5>"]
    data, done = fmt.events([(a, [6], ""), final(a, [7], [5, 5, 6, 7])])
    events = payloads(data)
    assert done and events[-1] == "[DONE]"
    last = json.loads(events[0])["choices"][0]
    assert (last["text"], last["finish_reason"]) == ("<6><7>", "length")
    assert json.loads(events[1])["usage"]["completion_tokens"] == 4


def test_a_failed_choice_still_sends_the_text_before_it_then_the_error() -> None:
    fmt, (a, b) = formatter(2)
    data, done = fmt.events([(a, [5], ""), Final(b, [], "", None, "the engine stopped", True)])
    events = payloads(data)
    assert done and events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["text"] == "<5>"
    assert json.loads(events[1])["error"]["type"] == "server_error"


def test_the_stand_in_engine_gives_one_token_per_request_each_step_and_honours_abort() -> None:
    engine = FakeEngine(FakeSpec(step_ms=0.1, max_num_seqs=2))
    tracker = DeltaTracker(None)
    for name in ("a", "b", "c"):
        engine.add_request([1], SamplingParams(max_tokens=3), name)
    first = engine.step_tokens(tracker)
    assert [(d.request_id, len(d.token_ids)) for d in first] == [("a", 1), ("b", 1)], "c waits for a free seat"
    assert engine.abort("b")
    second = engine.step_tokens(tracker)
    ended = {d.request_id: d.output.finish_reason for d in second if d.output is not None}
    assert ended == {"b": "abort"}
    outputs = {}
    while engine.has_unfinished:
        outputs.update({d.request_id: d.output for d in engine.step_tokens(tracker) if d.output is not None})
    assert {k: (len(o.output_token_ids), o.finish_reason) for k, o in outputs.items()} == {
        "a": (3, "length"), "c": (3, "length")}


def test_the_engine_loop_told_to_stop_ends_what_runs_and_returns() -> None:
    inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
    frames: list[Frame] = []
    inbox.put(Submit([("a", [1], SamplingParams(max_tokens=1000))], final_only=False))
    inbox.put(Stop("the server is shutting down"))
    runner = threading.Thread(target=EngineLoop(FakeEngine(FakeSpec(step_ms=0.1)), inbox, frames.append).run,
                              daemon=True)
    runner.start()
    runner.join(10)
    assert not runner.is_alive(), "the engine loop kept waiting for commands after Stop"
    finals = [final for frame in frames if isinstance(frame, StepFrame) for final in frame.finals]
    assert [(f.request_id, f.ended_by) for f in finals] == [("a", "the server is shutting down")]


def test_an_idle_engine_loop_notices_its_engine_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    """With nothing to do, the loop still asks the engine every IDLE_CHECK_S; a failure is sent at once."""
    from corelib.server import engine_loop

    monkeypatch.setattr(engine_loop, "IDLE_CHECK_S", 0.05)

    class Gone(FakeEngine):
        def check_alive(self) -> None:
            raise WorkerDied("node 1 (worker rank 1) is gone: its connection closed")

    inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
    frames: list[Frame] = []
    runner = threading.Thread(target=EngineLoop(Gone(FakeSpec(step_ms=0.1)), inbox, frames.append).run, daemon=True)
    runner.start()
    deadline = time.monotonic() + 10
    while not frames and time.monotonic() < deadline:
        time.sleep(0.01)
    inbox.put(Submit([("late", [1], SamplingParams(max_tokens=3))], final_only=False))
    inbox.put(Stop("the server is shutting down"))
    runner.join(10)
    assert not runner.is_alive()
    failures = [frame.failure for frame in frames if isinstance(frame, StepFrame) and frame.failure]
    assert failures and "node 1 (worker rank 1) is gone" in failures[0], frames
    finals = [final for frame in frames if isinstance(frame, StepFrame) for final in frame.finals]
    # It never started: the server answers 503 (unavailable), as it does once it knows of the failure itself.
    assert [(f.request_id, f.server_error) for f in finals] == [("late", False)]
