"""Per-request state: sampling values, tokens, KV blocks and timings. Pure Python."""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field

from corelib.errors import RequestError

MAX_LOGPROBS = 20  # the most alternatives a token's logprobs list (OpenAI's top_logprobs bound)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0  # 1: no cut
    seed: int = 0  # makes sampling reproducible whatever the batch
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = ()  # checked on the host; such steps run synchronously
    logprobs: int | None = None  # None: none; k: each output token's log-probability and the k most likely

    def validate(self, vocab_size: int) -> None:
        """Raise a RequestError naming the first invalid field."""
        self._check_types()
        if self.max_tokens < 1:
            raise RequestError(f"sampling.max_tokens={self.max_tokens}: must be at least 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"sampling.temperature={self.temperature}: must be a finite number >= 0")
        if self.top_k < 0:
            raise RequestError(f"sampling.top_k={self.top_k}: must be >= 0 (0 disables it)")
        if not 0 < self.top_p <= 1 or not math.isfinite(self.top_p):
            raise RequestError(f"sampling.top_p={self.top_p}: must be in (0, 1]")
        if not 0 <= self.seed < 2**62:
            raise RequestError(f"sampling.seed={self.seed}: must be in [0, 2**62)")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"sampling.stop_token_ids: {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if "" in self.stop_strings:
            raise RequestError("sampling.stop_strings: an empty string would stop every request at its first token")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise RequestError(f"sampling.logprobs={self.logprobs}: must be in [0, {MAX_LOGPROBS}] or None")

    def _check_types(self) -> None:
        # Python callers are not type-checked: a float max_tokens or a str temperature would
        # otherwise fail deep inside, or quietly round.
        if self.logprobs is not None and (not isinstance(self.logprobs, numbers.Integral)
                                          or isinstance(self.logprobs, bool)):
            raise RequestError(f"sampling.logprobs={self.logprobs!r}: must be an integer or None")
        for name in ("max_tokens", "top_k", "seed"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise RequestError(f"sampling.{name}={value!r}: must be an integer, not {type(value).__name__}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise RequestError(f"sampling.{name}={value!r}: must be a number, not {type(value).__name__}")
        if isinstance(self.stop_strings, str):
            raise RequestError(f"sampling.stop_strings={self.stop_strings!r}: pass a tuple of strings, not one string")
        if not all(isinstance(s, str) for s in self.stop_strings):
            raise RequestError(f"sampling.stop_strings={self.stop_strings!r}: every stop string must be a str")
        ids = self.stop_token_ids
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
            raise RequestError(f"sampling.stop_token_ids={ids!r}: token ids must be integers")


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability under the logits it was sampled from, and the most likely ones."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


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


@dataclass(frozen=True)
class StopFacts:
    """When a request ends, decided once when the scheduler takes it (``StopChecker.facts_of``)."""

    stop_ids: frozenset[int]  # sampled ids that end it: its stop ids, and EOS unless ignore_eos
    output_limit: int  # outputs at which it ends for length: max_tokens, or what the model's length leaves
    host_checks: bool  # its text is checked for stop strings after every token


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
    # Tokens whose keys and values are in the KV cache once every submitted step has run: a prompt
    # is fed in chunks from here (a prefix found in the cache starts it past 0), a decode row feeds one.
    num_computed_tokens: int = 0
    # Prefix caching: the chained keys of the full blocks of its tokens (fixed by the tokens), and how
    # many blocks of its table are keyed in the cache.
    block_keys: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    state_index: int | None = None  # the token relay's and the recurrent state's row (KV slots are per token)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    text: str = ""  # decoded output when the host checks stop strings or has a tokenizer
    # The per-step requirements of the async gate this request fails, one bit each, computed once
    # when it is added (corelib.options.StepCheck); None until then.
    sync_mask: int | None = None
    ends: StopFacts | None = None  # set when the scheduler takes the request
    num_prompt_tokens: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)  # a prompt never changes
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token when asked for

    @property
    def num_tokens(self) -> int:
        """Tokens the host knows: prompt plus outputs seen so far."""
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens that exist once every submitted step has finished."""
        return self.num_prompt_tokens + len(self.output_token_ids) + self.num_pending

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to feed before the next sample: 1 for a decoding sequence, more within its prompt."""
        return self.num_scheduled_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def needs_host_checks(self) -> bool:
        return bool(self.sampling.stop_strings)

    def token_at(self, position: int) -> int:
        prompt = self.num_prompt_tokens
        return self.prompt_token_ids[position] if position < prompt else self.output_token_ids[position - prompt]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
