"""OpenAI response bodies: a whole completion, or Server-Sent Events chunk by chunk.

finish_reason is ``stop`` (EOS, a stop token id or a stop string) or ``length`` (max_tokens or
the model's context). A request the engine refused (``error``) or the server ended (shutdown,
engine failure) is answered with an OpenAI error object: the whole response before streaming
starts, a ``data: {"error": ...}`` event after. A client that went away is sent nothing.

Logprobs, where asked for, come as OpenAI shapes them: a completion choice's ``logprobs`` holds
``tokens``, ``token_logprobs``, ``top_logprobs`` (token -> logprob) and ``text_offset``; a chat
choice's holds ``content``, one entry per token with its ``bytes`` and ``top_logprobs``. A stream's
chunk carries those of the tokens it brings.

A prompt's logprobs (``prompt_logprobs``, vLLM's extra) come as vLLM's server shows them: a completion
choice's ``prompt_logprobs`` (a chat response's, once for its one prompt) is a list with one entry per
prompt token, null for the first, else ``{"<token id>": {"logprob", "rank", "decoded_token"}}``, the
prompt's token first. With ``echo`` and ``logprobs``, a completion choice's ``logprobs`` start with
its prompt's tokens (the first one's logprob and top_logprobs null), and ``text_offset`` counts from
the start of the echoed text. They come with each request's last update, so only whole responses
carry them (a stream asking for them is refused in :mod:`corelib.server.inputs`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

from corelib.engine.outputs import PromptLogprobs
from corelib.engine.sequence import TokenLogprobs, token_logprobs_of
from corelib.server.inputs import Prepared, token_text
from corelib.server.messages import Delta, Final, LogprobDelta, Update
from corelib.server.protocol import ApiError, JsonObject

FINISH_REASONS = {"stop": "stop", "length": "length"}
# vLLM's floor for a prompt token's logprob: a prompt may hold a token the model all but rules out (-inf in
# float32), and JSON has no infinity.
LOGPROB_FLOOR = -9999.0


def failure(update: Final) -> ApiError | None:
    """The error to answer for a request that did not finish normally, or None."""
    if update.ended_by is not None:
        if update.server_error:
            return ApiError(500, update.ended_by, "server_error")
        return ApiError(503, update.ended_by, "service_unavailable")
    output = update.output
    if output is None or output.finish_reason in FINISH_REASONS:
        return None
    if output.finish_reason == "error":
        return ApiError(400, output.error or "the engine refused the request")
    return ApiError(503, f"the request ended early ({output.finish_reason})", "service_unavailable")


@dataclass
class Formatter:
    """Shapes one HTTP request's choices as a completion or a chat completion."""

    chat: bool
    model: str
    prepared: Prepared
    has_tokenizer: bool
    include_usage: bool = False
    token_str: Callable[[int], str] = field(default=lambda token: token_text([token]))  # one token's text
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    _templates: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # per choice: a chunk around its text
    _index: dict[str, int] = field(default_factory=dict)  # streaming: request id -> choice
    _left: int = 0  # streaming: choices not finished yet
    _completion_tokens: int = 0
    _offsets: dict[int, int] = field(default_factory=dict)  # streaming completions: each choice's text so far
    echo: list[str] | None = None  # completions' echo: each prompt's text, before its choices' text

    @property
    def wants_logprobs(self) -> bool:
        return any(sampling.logprobs is not None for _, sampling in self.prepared.requests)

    def logprobs(self, items: Sequence[TokenLogprobs], index: int = 0) -> JsonObject:
        """The logprobs of ``items`` (tokens of choice ``index``) as OpenAI shapes them."""
        token = self.token_str
        if self.chat:
            def entry(token_id: int, logprob: float) -> JsonObject:
                text = token(token_id)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

            return {"content": [{**entry(i.token_id, i.logprob), "top_logprobs": [entry(t, p) for t, p in i.top]}
                                for i in items]}
        texts = [token(i.token_id) for i in items]
        offsets, at = [], self._offsets.get(index, 0)
        for text in texts:
            offsets.append(at)
            at += len(text)
        self._offsets[index] = at
        return {"tokens": texts, "token_logprobs": [i.logprob for i in items],
                "top_logprobs": [{token(t): p for t, p in i.top} for i in items], "text_offset": offsets}

    def _final_logprobs(self, update: Final, index: int, whole: bool) -> JsonObject | None:
        output = update.output
        if output is None or output.logprobs is None:
            return None
        return self.logprobs(self._output_logprobs(update, index, whole), index)

    def _output_logprobs(self, update: Final, index: int, whole: bool) -> list[TokenLogprobs]:
        """The logprobs of a final output (vLLM's dicts) as the stream's, all of them or those of its new tokens."""
        output = update.output
        assert output is not None and output.logprobs is not None
        count = self.prepared.requests[index][1].logprobs or 0
        first = 0 if whole else len(output.logprobs) - len(update.token_ids)
        pairs = zip(output.output_token_ids[first:], output.logprobs[first:], strict=True)
        return [token_logprobs_of(token, entry, count) for token, entry in pairs]

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _head(self, chunk: bool) -> JsonObject:
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        kind = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": prefix + self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self, completion_tokens: int) -> JsonObject:
        prompt_tokens = self.prepared.num_prompt_tokens
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def text(self, update: Final) -> str:
        return update.text if self.has_tokenizer else token_text(update.token_ids)

    def final_text(self, update: Final) -> str:
        output = update.output
        if output is None:
            return ""
        return (output.text or "") if self.has_tokenizer else token_text(output.output_token_ids)

    # ------------------------------------------------------------------ prompt logprobs
    def _prompts_logprobs(self, finals: list[Final]) -> dict[tuple[int, ...], PromptLogprobs]:
        """Each prompt's logprobs, from the one choice that computed them (``_prepared`` asks one per prompt)."""
        found: dict[tuple[int, ...], PromptLogprobs] = {}
        for update in finals:
            output = update.output
            if output is not None and output.prompt_logprobs is not None \
                    and len(output.prompt_logprobs) == len(output.prompt_token_ids):
                found.setdefault(tuple(output.prompt_token_ids), output.prompt_logprobs)
        return found

    def _prompt_of(self, index: int) -> list[int]:
        return self.prepared.prompts[index // self._per_prompt]

    def _shown_prompt_logprobs(self, prompt: list[int], entries: PromptLogprobs, count: int) -> list[JsonObject | None]:
        """vLLM's ``prompt_logprobs`` of a prompt: per token its own entry, then the ``count`` likeliest by rank."""
        shown: list[JsonObject | None] = []
        for token, entry in zip(prompt, entries, strict=True):
            if entry is None:
                shown.append(None)
                continue
            shown.append({str(t): {"logprob": max(lp.logprob, LOGPROB_FLOOR), "rank": lp.rank,
                                   "decoded_token": self.token_str(t) if lp.decoded_token is None else lp.decoded_token}
                          for t, lp in entry.items() if t == token or (lp.rank or 0) <= count})
        return shown

    def _echo_logprobs(self, index: int, entries: PromptLogprobs, generated: JsonObject | None) -> JsonObject:
        """Choice ``index``'s completions logprobs with echo: its prompt's tokens, then its generated ones."""
        prompt, count = self._prompt_of(index), self.prepared.requests[index][1].logprobs or 0
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        at = 0
        for token, entry in zip(prompt, entries, strict=True):
            text = self.token_str(token)
            tokens.append(text)
            offsets.append(at)
            at += len(text)
            if entry is None:
                values.append(None)
                tops.append(None)
                continue
            item = token_logprobs_of(token, entry, count)
            values.append(max(item.logprob, LOGPROB_FLOOR))
            tops.append({self.token_str(t): max(p, LOGPROB_FLOOR) for t, p in item.top})
        joined: JsonObject = {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
        for key, value in (generated or {}).items():
            joined[key] = [*cast(list[object], joined[key]), *cast(list[object], value)]
        return joined

    # ------------------------------------------------------------------ whole responses
    def response(self, finals: list[Final]) -> JsonObject:
        choices: list[JsonObject] = []
        completion_tokens = 0
        shown = self.prepared.prompt_logprobs
        prompts = self._prompts_logprobs(finals) if shown is not None or self.prepared.echo_logprobs else {}
        for index, update in enumerate(finals):
            output = update.output
            assert output is not None, "a failed choice is answered with an error, not a response"
            completion_tokens += len(output.output_token_ids)
            reason = FINISH_REASONS[output.finish_reason]
            echoed = self.echoed(index)
            self._offsets[index] = len(echoed)  # the generated tokens' text_offset: after the echoed text
            logprobs = self._final_logprobs(update, index, whole=True)
            prompt = self._prompt_of(index)
            entries = prompts.get(tuple(prompt)) if prompts else None  # a request that asks none pays nothing
            if self.chat:
                message = {"role": "assistant", "content": self.final_text(update)}
                choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason})
                continue
            if self.prepared.echo_logprobs and entries is not None:
                logprobs = self._echo_logprobs(index, entries, logprobs)
            choice: JsonObject = {"index": index, "text": echoed + self.final_text(update), "logprobs": logprobs,
                                  "finish_reason": reason}
            if shown is not None:
                choice["prompt_logprobs"] = None if entries is None else self._shown_prompt_logprobs(prompt, entries,
                                                                                                     shown)
            choices.append(choice)
        body: JsonObject = {**self._head(chunk=False), "choices": choices, "usage": self.usage(completion_tokens)}
        if self.chat and shown is not None:  # vLLM's chat response carries its one prompt's, beside the choices
            entries = prompts.get(tuple(self.prepared.prompts[0]))
            body["prompt_logprobs"] = None if entries is None else self._shown_prompt_logprobs(
                self.prepared.prompts[0], entries, shown)
        return body

    # ------------------------------------------------------------------ streaming
    def _chunk(self, index: int, text: str | None, reason: str | None, role: bool = False,
               logprobs: JsonObject | None = None) -> bytes:
        choice: JsonObject
        if self.chat:
            delta: JsonObject = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        body: JsonObject = {**self._head(chunk=True), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return event(body)

    def _text_chunk(self, index: int, text: str) -> bytes:
        """``_chunk(index, text, None)``, built around one ``json.dumps`` of the text: the hot path of streaming."""
        cut = self._templates.get(index)
        if cut is None:
            marker = "\u0000"  # json.dumps escapes it, so it appears nowhere else in the chunk
            head, tail = self._chunk(index, marker, None).split(json.dumps(marker).encode(), 1)
            cut = self._templates[index] = (head, tail)
        return cut[0] + json.dumps(text, ensure_ascii=False).encode() + cut[1]

    def start(self, request_ids: list[str]) -> bytes:
        """What a stream begins with (a chat names the assistant's role in each choice); then :meth:`events`."""
        self._index = {request_id: i for i, request_id in enumerate(request_ids)}
        self._left = len(request_ids)
        self._completion_tokens = 0
        if not self.chat:  # with echo, each choice's first chunk is its prompt's text
            return b"".join(self._chunk(i, self.echoed(i), None) for i in range(len(request_ids)) if self.echoed(i))
        return b"".join(self._chunk(i, None, None, role=True) for i in range(len(request_ids)))

    def echoed(self, index: int) -> str:
        """The prompt text choice ``index`` starts with (its prompt's, with echo), else ''."""
        if self.echo is None:
            return ""
        return self.echo[index // self._per_prompt]

    @property
    def _per_prompt(self) -> int:
        return len(self.prepared.requests) // len(self.prepared.prompts)  # n choices per prompt

    def events(self, batch: list[Update]) -> tuple[bytes, bool]:
        """The SSE events of every update since the last call, and whether the stream is complete.

        All the new text of a choice makes one event: a client that reads a step late, or a
        server that writes it late, sends one event where it would have sent several.
        """
        if len(batch) == 1 and type(batch[0]) is tuple:  # the common case: one choice, one step's tokens
            request_id, token_ids, text = cast(Delta, batch[0])
            text = text if self.has_tokenizer else token_text(token_ids)
            return (self._text_chunk(self._index[request_id], text) if text else b""), False
        texts: dict[int, list[str]] = {}
        scores: dict[int, list[TokenLogprobs]] = {}  # choices that asked for logprobs: those of their new tokens
        out: list[bytes] = []
        for update in batch:
            i = self._index[update[0]]
            if type(update) is not Final:
                text = update[2] if self.has_tokenizer else token_text(update[1])
                if text:
                    texts.setdefault(i, []).append(text)
                if type(update) is LogprobDelta:
                    scores.setdefault(i, []).extend(update.logprobs)
                continue
            assert isinstance(update, Final), "a batch holds deltas and finals only"
            problem = failure(update)
            if problem is not None:
                out += self._pending(texts, scores)
                return b"".join([*out, event(problem.body()), DONE]), True
            assert update.output is not None, "a final without an error carries the engine's output"
            self._completion_tokens += len(update.output.output_token_ids)
            text = "".join(texts.pop(i, ())) + self.text(update)
            logprobs = None
            if update.output.logprobs is not None:
                tail = self._output_logprobs(update, i, whole=False)
                logprobs = self.logprobs([*scores.pop(i, ()), *tail], i)
            out.append(self._chunk(i, text, FINISH_REASONS[update.output.finish_reason], logprobs=logprobs))
            self._left -= 1
        out += self._pending(texts, scores)
        if self._left > 0:
            return b"".join(out), False
        if self.include_usage:
            out.append(event({**self._head(chunk=True), "choices": [], "usage": self.usage(self._completion_tokens)}))
        out.append(DONE)
        return b"".join(out), True


    def _pending(self, texts: dict[int, list[str]], scores: dict[int, list[TokenLogprobs]]) -> list[bytes]:
        """The chunks of the choices with new text that did not finish in this batch."""
        out = []
        for j, pieces in texts.items():
            if j in scores:
                out.append(self._chunk(j, "".join(pieces), None, logprobs=self.logprobs(scores.pop(j), j)))
            else:
                out.append(self._text_chunk(j, "".join(pieces)))
        out += [self._chunk(j, "", None, logprobs=self.logprobs(items, j)) for j, items in scores.items() if items]
        return out


def event(body: JsonObject) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
