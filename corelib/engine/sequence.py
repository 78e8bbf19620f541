"""Per-request state: sampling values, tokens, KV blocks and timings. Pure Python."""

from __future__ import annotations

import array
import enum
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from corelib.sampling_params import MAX_LOGPROBS, SEED_LIMIT, FinishReason, SamplingParams

if TYPE_CHECKING:
    from corelib.engine.stops import StopScan
    from corelib.engine.structured import GrammarState

__all__ = ["MAX_LOGPROBS", "FinishReason", "Logprob", "SamplingParams", "Sequence", "Status", "TokenLogprobs",
           "logprob_dict"]


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability under the logits it was sampled from, and the most likely ones
    (as the device reports them; outputs show them as vLLM does: :func:`logprob_dict`)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first
    rank: int = 1  # tokens at least as likely as it, itself included (1: the likeliest)


@dataclass
class Logprob:
    """vLLM's ``Logprob``: a token's log-probability, its rank among the vocabulary (1: the likeliest) and
    its text (None without a tokenizer, or with ``detokenize=False``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def logprob_dict(item: TokenLogprobs, token_text: Callable[[int], str] | None = None) -> dict[int, Logprob]:
    """One token's logprobs as vLLM gives them: {token id: Logprob}, the sampled token first, then the top
    ones by rank (the sampled one once, with its place among them where it is one of them). So the dict
    holds ``len(top)`` entries when the sampled token is among the top ones, one more when it is not."""
    ranks = {token: rank for rank, (token, _) in enumerate(item.top, start=1)}

    def text(token: int) -> str | None:
        return None if token_text is None else token_text(token)

    out = {item.token_id: Logprob(item.logprob, ranks.get(item.token_id, item.rank), text(item.token_id))}
    for rank, (token, value) in enumerate(item.top, start=1):
        if token not in out:
            out[token] = Logprob(value, rank, text(token))
    return out


def token_logprobs_of(token_id: int, entry: dict[int, Logprob], count: int) -> TokenLogprobs:
    """The inverse of :func:`logprob_dict` for a request that asked for ``count`` alternatives: the sampled
    token is one of them unless the dict holds one entry more (ranks may tie, so they cannot tell)."""
    sampled = entry[token_id]
    others = [(t, p) for t, p in entry.items() if len(entry) <= count or t != token_id]
    top = sorted(others, key=lambda item: item[1].rank if item[1].rank is not None else 0)[:count]
    return TokenLogprobs(token_id, sampled.logprob, tuple((t, p.logprob) for t, p in top), sampled.rank or 1)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class StopFacts:
    """When a request ends, decided once when the scheduler takes it (``StopChecker.facts_of``)."""

    stop_ids: frozenset[int]  # sampled ids that end it: its stop ids, and EOS unless ignore_eos
    output_limit: int  # outputs at which it ends for length: max_tokens, or what the model's length leaves
    host_checks: bool  # its text is checked for stop strings after every token
    min_tokens: int = 0  # no stop id or stop string ends it before it has more outputs than this


@dataclass(eq=False)
class Sequence:
    """One request as the scheduler sees it; two are equal only when they are the same request (the
    scheduler's lists look their sequences up by identity, not by comparing every field)."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    multimodal: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    # vLLM's stop_reason: the stop string or stop token id that ended it; None at EOS, length or an error.
    stop_reason: int | str | None = None
    stop_text_at: int = -1  # where in ``text`` the stop string that ended it starts
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
    stop_scan: StopScan | None = None  # how far the stop-string check has decoded ``text`` (StopChecker)
    # Structured output: the matcher that writes the row's token mask before each sample and takes each token.
    grammar: GrammarState | None = None
    prompt: str | None = None  # the prompt's text, when it was given as text
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token when asked for
    # prompt_logprobs: entry i is prompt token i + 1's (the first has none), filled as the prompt's chunks are read.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # The per-step requirements of the async gate this request fails, one bit each, computed once
    # when it is added (corelib.config.options.StepCheck); None until then.
    sync_mask: int | None = None
    ends: StopFacts | None = None  # set when the scheduler takes the request
    num_prompt_tokens: int = field(init=False, default=0)
    _prompt_ids: array.array[int] | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)  # a prompt never changes
        if self.sampling.seed is None:  # fresh randomness, fixed for the request's life (preemption included)
            self.sampling = self.sampling.replace(seed=secrets.randbelow(SEED_LIMIT))

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

    def prompt_ids(self) -> array.array[int]:
        """The prompt as int64 values in one buffer, made at its first use and kept (a prompt never changes): the
        prefix cache hashes its blocks from it and the packer copies its chunks from it, neither converting each
        token again."""
        ids = self._prompt_ids
        if ids is None:
            ids = self._prompt_ids = array.array("q", self.prompt_token_ids)
        return ids

    def token_at(self, position: int) -> int:
        prompt = self.num_prompt_tokens
        return self.prompt_token_ids[position] if position < prompt else self.output_token_ids[position - prompt]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
