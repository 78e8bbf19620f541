"""When a request stops: end-of-sequence ids, stop ids and strings, max_tokens, the model's length."""

from __future__ import annotations

from collections.abc import Callable

from corelib.engine.sequence import FinishReason, Sequence, StopFacts


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

    def facts_of(self, seq: Sequence) -> StopFacts:
        """What ends ``seq``: decided once, when it is added (its sampling and prompt never change)."""
        sampling = seq.sampling
        ids = frozenset(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            ids |= self.eos_token_ids
        limit = min(sampling.max_tokens, self.max_model_len - seq.num_prompt_tokens)
        return StopFacts(ids, limit, bool(sampling.stop_strings))

    def may_stop(self, seq: Sequence, token: int) -> bool:
        """Whether :meth:`stop_reason` can be anything but None for ``token``: one set lookup and a
        comparison, so a step's rows that go on cost next to nothing."""
        ends = seq.ends
        if ends is None:
            return True
        return token in ends.stop_ids or ends.host_checks or len(seq.output_token_ids) >= ends.output_limit

    def stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        """Called after ``token`` was appended to ``seq``'s output."""
        ends = seq.ends
        if ends is None:
            ends = seq.ends = self.facts_of(seq)
        if token in ends.stop_ids:
            return FinishReason.stop
        if ends.host_checks:
            seq.text = self._detokenize(seq.output_token_ids)
            if any(stop in seq.text for stop in seq.sampling.stop_strings):
                return FinishReason.stop
        if len(seq.output_token_ids) >= ends.output_limit:
            return FinishReason.length
        return None
