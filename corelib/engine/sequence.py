"""Per-request state: sampling values, tokens, KV blocks and timings. Pure Python."""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field

from corelib.sampling_params import SEED_LIMIT, SamplingParams

__all__ = ["FinishReason", "SamplingParams", "Sequence", "Status"]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    stop = "stop"  # EOS, a stop token id or a stop string
    length = "length"  # max_tokens or the model's maximum length
    error = "error"  # the request was invalid or its work failed
    cancelled = "cancelled"  # the engine shut down first
    abort = "abort"  # the caller aborted it (Engine.abort, or a client that went away)


@dataclass
class Sequence:
    """One request as the scheduler sees it."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    multimodal: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    block_table: list[int] = field(default_factory=list)
    # Bumped whenever the block table is dropped, so cached copies of it know to start over.
    blocks_epoch: int = 0
    # Tokens sampled on the device whose values the host has not seen yet (async handoff).
    num_pending: int = 0
    state_index: int | None = None  # the token relay's and the recurrent state's row (KV slots are per token)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    text: str = ""  # decoded output when the host checks stop strings or has a tokenizer
    prompt: str | None = None  # the prompt's text, when it was given as text

    def __post_init__(self) -> None:
        if self.sampling.seed is None:  # fresh randomness, fixed for the request's life (preemption included)
            self.sampling = self.sampling.replace(seed=secrets.randbelow(SEED_LIMIT))

    @property
    def num_tokens(self) -> int:
        """Tokens the host knows: prompt plus outputs seen so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens that exist once every submitted step has finished."""
        return self.num_tokens + self.num_pending

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def needs_host_checks(self) -> bool:
        return bool(self.sampling.stop_strings)

    def token_at(self, position: int) -> int:
        prompt = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < prompt else self.output_token_ids[position - prompt]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
