"""Commands to the engine process: written by the thread that sends them when the pipe takes them, in order always.

A request reaches the engine without waiting for another thread to get the GIL (which takes up to the
interpreter's switch interval while the event loop streams); an engine that reads slowly, or not at all,
never blocks the sender, and what it has not taken yet follows in the order it was sent.
"""

from __future__ import annotations

import fcntl
import os
import select
from collections.abc import Iterator

import pytest

from corelib.engine.sequence import SamplingParams
from corelib.server.commands import CommandWriter
from corelib.server.messages import Abort, Command, Decoder, Drain, Submit

F_SETPIPE_SZ = 1031


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    read, write = os.pipe()
    fcntl.fcntl(write, F_SETPIPE_SZ, 4096)  # the smallest pipe: a long prompt does not fit at once
    yield read, write  # the test's CommandWriter closes the writing end
    os.close(read)


def received(fd: int, count: int) -> list[object]:
    """``count`` commands read from ``fd`` (waiting for each, bounded)."""
    decoder, got = Decoder(), list[object]()
    while len(got) < count:
        readable, _, _ = select.select([fd], [], [], 30)
        assert readable, f"{len(got)} of {count} commands arrived"
        got += decoder.feed(os.read(fd, 1 << 16))
    return got


def submit(request_id: str, tokens: int) -> Submit:
    return Submit([(request_id, list(range(tokens)), SamplingParams(max_tokens=4))], final_only=False)


def test_a_command_the_pipe_takes_is_written_before_send_returns(pipe: tuple[int, int]) -> None:
    read, write = pipe
    writer = CommandWriter(write, start=False)  # no thread that could write it later
    writer.send(submit("req-0", 100))
    readable, _, _ = select.select([read], [], [], 0)
    assert readable, "the command waits for another thread to write it"
    assert received(read, 1) == [submit("req-0", 100)]
    writer.close(1.0)


def test_what_the_pipe_cannot_take_yet_follows_in_the_order_it_was_sent(pipe: tuple[int, int]) -> None:
    read, write = pipe
    writer = CommandWriter(write)
    sent: list[Command] = [submit("req-0", 20_000), Abort(["req-0"]), submit("req-1", 3), Drain(1.0)]
    for command in sent:
        writer.send(command)  # the first fills the pipe: the others queue behind its rest
    assert received(read, len(sent)) == sent
    writer.send(Abort(["req-1"]))  # the pipe takes it now: written at once again
    assert received(read, 1) == [Abort(["req-1"])]
    writer.close(5.0)


def test_an_engine_that_reads_nothing_never_blocks_the_sender_or_its_close(pipe: tuple[int, int]) -> None:
    _, write = pipe
    writer = CommandWriter(write)
    for number in range(20):
        writer.send(submit(f"req-{number}", 5_000))  # far more than the pipe holds, nobody reading
    writer.close(0.1)  # its thread gives up on the pipe; the pipe is closed
    writer.send(Abort(["req-0"]))  # after close: dropped, never written to a closed descriptor


def test_commands_sent_after_the_end_are_dropped(pipe: tuple[int, int]) -> None:
    read, write = pipe
    writer = CommandWriter(write)
    writer.send(Abort(["req-0"]))
    writer.end()
    writer.send(Abort(["req-1"]))
    writer.close(5.0)
    assert received(read, 1) == [Abort(["req-0"])]
    assert os.read(read, 1 << 16) == b"", "nothing follows the end"
