"""What a finished request produced. Torch-free: the HTTP process reads these too.

The shapes are vLLM's: a sample's ``logprobs`` is one ``{token id: Logprob}`` per output token
(the sampled token first, then the ``logprobs`` most likely ones, each with its rank and text),
``cumulative_logprob`` the sum of the sampled tokens' (None when no logprobs were asked for, as
vLLM's V1 engine leaves it), and ``stop_reason`` the stop string or stop token id that ended the
sample (None at EOS, at the length limit or on an error).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from corelib.engine.sequence import FinishReason, Logprob, Sequence, TokenLogprobs, logprob_dict
from corelib.observe.rundir import RequestRecord

SampleLogprobs = list[dict[int, Logprob]]  # vLLM's name: one dict per output token
PromptLogprobs = list[dict[int, Logprob] | None]  # one per prompt token, None for the first


@dataclass(frozen=True)
class CompletionOutput:
    """One sample of a prompt, as vLLM names it: ``index``, ``text``, ``token_ids``, ``cumulative_logprob``,
    ``logprobs``, ``finish_reason``, ``stop_reason``."""

    index: int
    text: str  # "" without a tokenizer, or with detokenize=False
    token_ids: list[int]
    finish_reason: str
    error: str | None = None
    logprobs: SampleLogprobs | None = None  # one per output token, when the request asked for them
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """vLLM's: whether the sample ended (always, here: outputs are whole)."""
        return True


@dataclass(frozen=True)
class RequestOutput:
    """What a finished request produced; ``prompt``, ``prompt_token_ids``, ``prompt_logprobs`` and ``outputs``
    as in vLLM.

    ``outputs`` holds one :class:`CompletionOutput` per sample (``n`` of them for
    ``SamplingParams(n=...)``); ``output_token_ids``, ``text``, ``finish_reason``, ``error``,
    ``logprobs``, ``cumulative_logprob`` and ``stop_reason`` are the first sample's.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    text: str | None = None
    error: str | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    logprobs: SampleLogprobs | None = None  # one per output token, when the request asked for them
    prompt: str | None = None  # the prompt's text, when it was given as text
    outputs: list[CompletionOutput] = field(default_factory=list)
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # when the request asked for them

    def __post_init__(self) -> None:
        if not self.outputs:
            first = CompletionOutput(0, self.text or "", self.output_token_ids, self.finish_reason, self.error,
                                     self.logprobs, self.cumulative_logprob, self.stop_reason)
            object.__setattr__(self, "outputs", [first])

    @property
    def finished(self) -> bool:
        return True

    @classmethod
    def grouped(cls, samples: Seq[RequestOutput]) -> RequestOutput:
        """The samples of one prompt as one output: the first's fields, every sample in ``outputs``."""
        first = samples[0]
        outputs = [CompletionOutput(i, s.text or "", s.output_token_ids, s.finish_reason, s.error, s.logprobs,
                                    s.cumulative_logprob, s.stop_reason)
                   for i, s in enumerate(samples)]
        return cls(first.request_id, first.prompt_token_ids, first.output_token_ids, first.finish_reason,
                   first.text, first.error, first.ttft_ms, first.tpot_ms, first.logprobs, first.prompt, outputs,
                   first.cumulative_logprob, first.stop_reason, first.prompt_logprobs)

    def record(self) -> RequestRecord:
        return RequestRecord(
            id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=self.output_token_ids,
            finish_reason=self.finish_reason,
            text=self.text,
            error=self.error,
            ttft_ms=self.ttft_ms,
            tpot_ms=self.tpot_ms,
        )


def output_of(seq: Sequence, text: str | None, token_text: Callable[[int], str] | None = None) -> RequestOutput:
    """What ``seq`` produced, with ``text`` its final text (None without a tokenizer); ``token_text`` gives
    each logprob's ``decoded_token`` (None without a tokenizer or with ``detokenize=False``)."""
    ttft = tpot = None
    if seq.first_token_time is not None:
        ttft = (seq.first_token_time - seq.arrival_time) * 1e3
        if seq.finish_time is not None and len(seq.output_token_ids) > 1:
            tpot = (seq.finish_time - seq.first_token_time) * 1e3 / (len(seq.output_token_ids) - 1)
    reason = seq.finish_reason.value if seq.finish_reason is not None else FinishReason.cancelled.value
    logprobs = cumulative = None
    if seq.sampling.logprobs is not None:
        decode = token_text if seq.sampling.detokenize else None
        logprobs = sample_logprobs(seq.logprobs, decode)
        cumulative = math.fsum(item.logprob for item in seq.logprobs)
    stop_reason = seq.stop_reason if seq.finish_reason is FinishReason.stop else None
    prompt_logprobs = None
    if seq.sampling.prompt_logprobs is not None:
        decode = token_text if seq.sampling.detokenize else None
        prompt_logprobs = [None, *sample_logprobs(seq.prompt_logprobs, decode)]
    return RequestOutput(
        seq.request_id, list(seq.prompt_token_ids), list(seq.output_token_ids), reason,
        text, seq.error, ttft, tpot, logprobs, seq.prompt, cumulative_logprob=cumulative, stop_reason=stop_reason,
        prompt_logprobs=prompt_logprobs,
    )


def sample_logprobs(items: Seq[TokenLogprobs], token_text: Callable[[int], str] | None = None) -> SampleLogprobs:
    """The device's logprobs of some tokens in vLLM's shape (:func:`corelib.engine.sequence.logprob_dict`)."""
    return [logprob_dict(item, token_text) for item in items]
