"""What passes between the HTTP server and its engine loop: commands one way, one frame per step the other.

The engine loop runs on a thread of the server's process or in a process of its own
(:mod:`corelib.server.engine_process`); the messages are the same either way. Across processes
each is pickled behind a 4-byte length: the pipe joins a parent and the child it started, and a
step's frame (every running request's new tokens) costs tens of microseconds, a handful of
streamed events' worth.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from typing import NamedTuple

from corelib.engine.outputs import RequestOutput
from corelib.engine.sequence import SamplingParams, TokenLogprobs
from corelib.server.events import EngineFacts, Snapshot

LENGTH = struct.Struct("!I")


# ---------------------------------------------------------------------- server -> engine
@dataclass(frozen=True)
class Submit:
    requests: list[tuple[str, list[int], SamplingParams]]  # request id, prompt, sampling
    final_only: bool  # a whole response: only each request's last update is sent back


@dataclass(frozen=True)
class Abort:
    request_ids: list[str]


@dataclass(frozen=True)
class Drain:
    deadline: float  # time.monotonic(): one clock for every process of the machine


@dataclass(frozen=True)
class Ask:
    """Answer with a :class:`SnapshotFrame` between two steps."""

    token: int


@dataclass(frozen=True)
class Stop:
    why: str  # what the requests still running are told


Command = Submit | Abort | Drain | Ask | Stop


# ---------------------------------------------------------------------- engine -> server
Delta = tuple[str, list[int], str]  # request id, its new tokens, their text ('' without a tokenizer)


class LogprobDelta(NamedTuple):
    """New tokens of a request that asked for logprobs: a Delta with each token's logprobs."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs]


class Final(NamedTuple):
    """A request's last update: the engine's output, or why the server ended it."""

    request_id: str
    token_ids: list[int]
    text: str
    output: RequestOutput | None
    ended_by: str | None = None
    server_error: bool = False


Update = Delta | LogprobDelta | Final  # what an HTTP request hears about one of its choices


@dataclass(frozen=True)
class StepFrame:
    deltas: list[Delta | LogprobDelta]
    finals: list[Final]
    failure: str | None = None  # set once the engine failed: it takes no more requests


@dataclass(frozen=True)
class SnapshotFrame:
    token: int
    snapshot: Snapshot


@dataclass(frozen=True)
class Ready:
    facts: EngineFacts


@dataclass(frozen=True)
class Failed:
    """The engine could not be built; ``error`` is raised again in the server."""

    error: BaseException


Frame = StepFrame | SnapshotFrame | Ready | Failed


# ---------------------------------------------------------------------- bytes
def encode(message: Command | Frame) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return LENGTH.pack(len(payload)) + payload


class Decoder:
    """Messages out of a byte stream that arrives in pieces of any size."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[object]:
        buffer = self._buffer
        buffer += data
        messages: list[object] = []
        start = 0
        with memoryview(buffer) as view:
            while len(view) - start >= LENGTH.size:
                (size,) = LENGTH.unpack_from(view, start)
                end = start + LENGTH.size + size
                if len(view) < end:
                    break
                messages.append(pickle.loads(view[start + LENGTH.size : end]))
                start = end
        del buffer[:start]
        return messages

    @property
    def partial(self) -> bool:
        """Part of a message is waiting for the rest."""
        return bool(self._buffer)
