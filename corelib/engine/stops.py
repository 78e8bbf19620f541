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
from corelib.support.text import IncrementalDecoder


class StopScan:
    """One request's output text as the stop-string check builds it, a piece per token."""

    def __init__(self, detokenize: Callable[[list[int]], str], stops: tuple[str, ...]) -> None:
        self.decoder = IncrementalDecoder(detokenize)
        self.stops = stops

    def found(self, seq: Sequence, check: bool = True) -> tuple[str, int] | None:
        """Decode ``seq``'s tokens not seen yet onto ``seq.text``; the stop string that now ends in the new text
        (the one that starts first) and where in the text it starts, or None. ``check`` False: only decode
        (``min_tokens`` not reached: an occurrence in that text never counts)."""
        new = self.decoder.push(seq.output_token_ids[self.decoder.num_tokens :])
        if not new:
            return None  # no new character (one is still incomplete): nothing new can match
        seq.text += new
        if not check:
            return None
        text = seq.text
        hits = [stop for stop in self.stops if stop in tail(text, len(new), stop)]
        if not hits:
            return None
        # Each occurrence ends in the new text (none counted lay in the text before): the first to start wins.
        return min(((stop, text.find(stop, len(text) - len(tail(text, len(new), stop)))) for stop in hits),
                   key=lambda hit: hit[1])


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
        detokenize_special: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self._detokenize = detokenize or (lambda ids: "".join(f"<{t}>" for t in ids))
        self._detokenize_special = detokenize_special  # with special tokens kept (skip_special_tokens=False)

    def facts_of(self, seq: Sequence) -> StopFacts:
        """What ends ``seq``: decided once, when it is added (its sampling and prompt never change)."""
        sampling = seq.sampling
        ids = frozenset(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            ids |= self.eos_token_ids
        room = self.max_model_len - seq.num_prompt_tokens
        limit = room if sampling.max_tokens is None else min(sampling.max_tokens, room)
        return StopFacts(ids, limit, bool(sampling.stop_strings), sampling.min_tokens)

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
        # As vLLM: nothing but the length ends a request before it has more than min_tokens outputs (its
        # stop ids cannot be sampled before then: the device bans them).
        counted = len(seq.output_token_ids) > ends.min_tokens
        if counted and token in ends.stop_ids:
            # vLLM's stop_reason: the stop token id; None for EOS (unless it is one of the request's stop ids too).
            seq.stop_reason = token if token in seq.sampling.stop_token_ids else None
            return FinishReason.stop
        if ends.host_checks:
            scan = seq.stop_scan
            if scan is None:
                scan = seq.stop_scan = StopScan(self._decoder_of(seq), seq.sampling.stop_strings)
            hit = scan.found(seq, counted)
            if hit is not None:
                seq.stop_reason, seq.stop_text_at = hit
                return FinishReason.stop
        if len(seq.output_token_ids) >= ends.output_limit:
            return FinishReason.length
        return None

    def _decoder_of(self, seq: Sequence) -> Callable[[list[int]], str]:
        """The text the stop strings are looked for in: the output as the request will see it."""
        if seq.sampling.skip_special_tokens or self._detokenize_special is None:
            return self._detokenize
        return self._detokenize_special
