"""When a request stops: end-of-sequence ids, stop ids and strings, max_tokens, the model's length.

Stop strings are checked on the host after every token, so that check must not grow with the
output: the new tokens are decoded incrementally (a few tokens of context, as streaming does),
and each stop string is looked for only where it could end in the new text. Every earlier
position was looked at when its own token came, so the answer is the same as searching the
whole text each time.
"""

from __future__ import annotations

from collections.abc import Callable

from corelib.engine.sequence import FinishReason, Sequence, StopFacts
from corelib.text import IncrementalDecoder


class StopScan:
    """One request's output text as the stop-string check builds it, a piece per token."""

    def __init__(self, detokenize: Callable[[list[int]], str], stops: tuple[str, ...]) -> None:
        self.decoder = IncrementalDecoder(detokenize)
        self.stops = stops

    def found(self, seq: Sequence) -> bool:
        """Decode ``seq``'s tokens not seen yet onto ``seq.text``; whether a stop string now ends in the new text."""
        new = self.decoder.push(seq.output_token_ids[self.decoder.num_tokens :])
        if not new:
            return False  # no new character (one is still incomplete): nothing new can match
        seq.text += new
        text = seq.text
        return any(stop in tail(text, len(new), stop) for stop in self.stops)


def tail(text: str, new_chars: int, stop: str) -> str:
    """The end of ``text`` where ``stop`` can occur ending in its last ``new_chars`` characters.

    That is the last ``new_chars + len(stop) - 1`` characters: an occurrence that ends earlier
    lay in the text as it was before, which was searched then.
    """
    return text[max(0, len(text) - new_chars - len(stop) + 1) :]


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
            scan = seq.stop_scan
            if scan is None:
                scan = seq.stop_scan = StopScan(self._detokenize, seq.sampling.stop_strings)
            if scan.found(seq):
                return FinishReason.stop
        if len(seq.output_token_ids) >= ends.output_limit:
            return FinishReason.length
        return None
