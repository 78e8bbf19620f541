"""Token streaming: what each request gained since the last look, as ids and text.

Nothing here runs unless someone streams: the tracker compares the tokens the scheduler has
committed with what it already reported, once per engine iteration, on the host.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from corelib.engine.sequence import Sequence, TokenLogprobs
from corelib.support.text import IncrementalDecoder, Tokenizer

if TYPE_CHECKING:
    from corelib.engine.outputs import RequestOutput


@dataclass(frozen=True)
class TokenDelta:
    """New output of one request: token ids, and their text when the model has a tokenizer."""

    request_id: str
    token_ids: list[int]
    text: str  # '' without a tokenizer
    output: RequestOutput | None = None  # set on a request's last delta
    logprobs: list[TokenLogprobs] | None = None  # of token_ids, when the request asked for logprobs

    @property
    def finished(self) -> bool:
        return self.output is not None


class _TextState:
    """One request's streamed text. With stop strings, the tail that could start one is held back."""

    def __init__(self, decoder: IncrementalDecoder, stop_strings: tuple[str, ...], detokenize: bool = True) -> None:
        self.decoder = decoder
        self.hold = max((len(s) for s in stop_strings), default=1) - 1
        self.decoded = ""
        self.sent = 0
        self.detokenize = detokenize  # False: the request asked for token ids only

    def push(self, token_ids: list[int]) -> str:
        if not self.detokenize:
            return ""
        self.decoded += self.decoder.push(token_ids)
        ready = len(self.decoded) - self.hold
        if ready <= self.sent:
            return ""
        piece = self.decoded[self.sent : ready]
        self.sent = ready
        return piece

    def finish(self, final_text: str) -> str:
        # The final text is authoritative (cut at a stop string, every character complete).
        sent = self.decoded[: self.sent]
        return final_text[len(sent) :] if final_text.startswith(sent) else ""


class DeltaTracker:
    """Builds TokenDeltas from the scheduler's sequences; one per streaming consumer."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer
        self._sent: dict[int, int] = {}  # seq_id -> output tokens already reported
        self._text: dict[int, _TextState] = {}

    def _state(self, seq: Sequence) -> _TextState | None:
        if self._tokenizer is None:
            return None
        state = self._text.get(seq.seq_id)
        if state is None:
            state = self._text[seq.seq_id] = _TextState(self._tokenizer.stream(seq.sampling.skip_special_tokens),
                                                        seq.sampling.stop_strings, seq.sampling.detokenize)
        return state

    def running(self, seqs: Iterable[Sequence]) -> list[TokenDelta]:
        deltas = []
        for seq in seqs:
            sent = self._sent.get(seq.seq_id, 0)
            if len(seq.output_token_ids) <= sent:
                continue
            new = seq.output_token_ids[sent:]
            self._sent[seq.seq_id] = len(seq.output_token_ids)
            state = self._state(seq)
            deltas.append(TokenDelta(seq.request_id, new, state.push(new) if state else "", None,
                                     _logprobs(seq, sent)))
        return deltas

    def finished(self, done: Iterable[tuple[Sequence, RequestOutput]]) -> list[TokenDelta]:
        deltas = []
        for seq, output in done:
            sent = self._sent.pop(seq.seq_id, 0)
            new = output.output_token_ids[sent:]
            state = self._state(seq)
            self._text.pop(seq.seq_id, None)
            text = state.finish(output.text or "") if state is not None else ""
            deltas.append(TokenDelta(seq.request_id, new, text, output, _logprobs(seq, sent)))
        return deltas


def _logprobs(seq: Sequence, sent: int) -> list[TokenLogprobs] | None:
    return None if seq.sampling.logprobs is None else seq.logprobs[sent:]
