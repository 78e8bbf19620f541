"""What the server knows of its engine: its facts, snapshots of its state, and why it refuses a request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from corelib.support.text import Tokenizer

SHUTDOWN = "the server is shutting down"


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
    # what a request that leaves a sampling field out gets (model.sampling_defaults: generation_config.json's)
    sampling_defaults: tuple[tuple[str, Any], ...] = ()

    @property
    def max_prompt_chars(self) -> int:
        """A text longer than this cannot fit the context whatever its tokens: refused before it is tokenized."""
        return self.max_model_len * (self.tokenizer.longest_token_chars if self.tokenizer is not None else 1)


@dataclass(frozen=True)
class EngineFacts:
    """What an engine tells the server about itself; picklable, so it crosses from an engine process."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    model_name: str
    model_path: str | None
    tokenizer_path: str | None  # the tokenizer.json the engine decodes with; the server encodes with the same
    kv_blocks_total: int
    notices: tuple[str, ...] = ()  # what the engine had to say at start
    sampling_defaults: tuple[tuple[str, Any], ...] = ()  # model.sampling_defaults, as (field, value) pairs


@dataclass(frozen=True)
class Snapshot:
    """The engine's state between two steps."""

    waiting: int  # accepted, no token yet (queued or in prefill)
    running: int  # producing tokens
    kv_blocks_free: int
    kv_blocks_total: int
    occupancy: float | None  # device busy / (busy + idle) over recent steady decode
    failure: str | None
    prefix_cache: tuple[int, int] = (0, 0)  # prompt tokens looked up in the prefix cache, and found


class Overloaded(Exception):
    """More requests than engine.max_num_seqs + server.max_waiting are live."""


class TooLarge(Exception):
    """One request asks for more choices than the server ever holds at once."""


class Unavailable(Exception):
    """The server is shutting down, or the engine failed."""
