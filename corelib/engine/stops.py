"""When a request stops: end-of-sequence ids, stop ids and strings, max_tokens, the model's length."""

from __future__ import annotations

from collections.abc import Callable

from corelib.engine.sequence import FinishReason, Sequence


class StopChecker:
    """Decides, per sampled token, whether its request is done. Text checks need ``detokenize``."""

    def __init__(
        self,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        detokenize: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self._detokenize = detokenize or (lambda ids: "".join(f"<{t}>" for t in ids))

    def stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        """Called after ``token`` was appended to ``seq``'s output."""
        sampling = seq.sampling
        if token in self.eos_token_ids and not sampling.ignore_eos:
            return FinishReason.stop
        if token in sampling.stop_token_ids:
            return FinishReason.stop
        if seq.needs_host_checks:
            seq.text = self._detokenize(seq.output_token_ids)
            if any(stop in seq.text for stop in sampling.stop_strings):
                return FinishReason.stop
        if len(seq.output_token_ids) >= sampling.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.length
        return None
