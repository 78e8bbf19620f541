"""What a finished request produced. Torch-free: the HTTP process reads these too."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from corelib.engine.sequence import FinishReason, Sequence, TokenLogprobs
from corelib.rundir import RequestRecord


@dataclass(frozen=True)
class CompletionOutput:
    """One sample of a prompt, as vLLM names it: ``index``, ``text``, ``token_ids``, ``finish_reason``."""

    index: int
    text: str  # "" without a tokenizer
    token_ids: list[int]
    finish_reason: str
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per output token, when the request asked for them


@dataclass(frozen=True)
class RequestOutput:
    """What a finished request produced; ``prompt``, ``prompt_token_ids`` and ``outputs`` as in vLLM.

    ``outputs`` holds one :class:`CompletionOutput` per sample (``n`` of them for
    ``SamplingParams(n=...)``); ``output_token_ids``, ``text``, ``finish_reason`` and ``error``
    are the first sample's.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    text: str | None = None
    error: str | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per output token, when the request asked for them
    prompt: str | None = None  # the prompt's text, when it was given as text
    outputs: list[CompletionOutput] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.outputs:
            first = CompletionOutput(0, self.text or "", self.output_token_ids, self.finish_reason, self.error,
                                     self.logprobs)
            object.__setattr__(self, "outputs", [first])

    @property
    def finished(self) -> bool:
        return True

    @classmethod
    def grouped(cls, samples: Seq[RequestOutput]) -> RequestOutput:
        """The samples of one prompt as one output: the first's fields, every sample in ``outputs``."""
        first = samples[0]
        outputs = [CompletionOutput(i, s.text or "", s.output_token_ids, s.finish_reason, s.error, s.logprobs)
                   for i, s in enumerate(samples)]
        return cls(first.request_id, first.prompt_token_ids, first.output_token_ids, first.finish_reason,
                   first.text, first.error, first.ttft_ms, first.tpot_ms, first.logprobs, first.prompt, outputs)

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


def output_of(seq: Sequence, text: str | None) -> RequestOutput:
    """What ``seq`` produced, with ``text`` its final text (None without a tokenizer)."""
    ttft = tpot = None
    if seq.first_token_time is not None:
        ttft = (seq.first_token_time - seq.arrival_time) * 1e3
        if seq.finish_time is not None and len(seq.output_token_ids) > 1:
            tpot = (seq.finish_time - seq.first_token_time) * 1e3 / (len(seq.output_token_ids) - 1)
    reason = seq.finish_reason.value if seq.finish_reason is not None else FinishReason.cancelled.value
    return RequestOutput(
        seq.request_id, list(seq.prompt_token_ids), list(seq.output_token_ids), reason,
        text, seq.error, ttft, tpot, None if seq.sampling.logprobs is None else list(seq.logprobs), seq.prompt,
    )
