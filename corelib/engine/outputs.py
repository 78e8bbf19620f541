"""What a finished request produced. Torch-free: the HTTP process reads these too."""

from __future__ import annotations

from dataclasses import dataclass

from corelib.engine.sequence import FinishReason, Sequence, TokenLogprobs
from corelib.rundir import RequestRecord


@dataclass(frozen=True)
class RequestOutput:
    """What a finished request produced."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    text: str | None = None
    error: str | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per output token, when the request asked for them

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
        text, seq.error, ttft, tpot, None if seq.sampling.logprobs is None else list(seq.logprobs),
    )
