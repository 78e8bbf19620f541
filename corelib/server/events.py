"""What passes between the engine thread and the server: updates, engine facts, snapshots, refusals."""

from __future__ import annotations

from dataclasses import dataclass

from corelib.engine.api import RequestOutput
from corelib.text import Tokenizer

SHUTDOWN = "the server is shutting down"


@dataclass(frozen=True)
class Update:
    """New output of one request; the last one has ``output`` or ``ended_by``."""

    request_id: str
    token_ids: list[int]
    text: str
    output: RequestOutput | None = None  # the engine's final record
    ended_by: str | None = None  # the server ended the request: why
    server_error: bool = False  # ended by an engine failure (not by a shutdown)

    @property
    def finished(self) -> bool:
        return self.output is not None or self.ended_by is not None


@dataclass(frozen=True)
class EngineInfo:
    """Facts about the engine the server needs, read once when it is built."""

    tokenizer: Tokenizer | None
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    model_name: str
    model_path: str | None
    notices: tuple[str, ...] = ()  # what the engine had to say at start


@dataclass(frozen=True)
class Snapshot:
    """The engine's state between two steps."""

    waiting: int  # accepted, no token yet (queued or in prefill)
    running: int  # producing tokens
    kv_blocks_free: int
    kv_blocks_total: int
    occupancy: float | None  # device busy / (busy + idle) over recent steady decode
    failure: str | None


class Overloaded(Exception):
    """More requests than engine.max_num_seqs + server.max_waiting are live."""


class TooLarge(Exception):
    """One request asks for more choices than the server ever holds at once."""


class Unavailable(Exception):
    """The server is shutting down, or the engine failed."""
