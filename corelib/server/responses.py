"""OpenAI response bodies: a whole completion, or Server-Sent Events chunk by chunk.

finish_reason is ``stop`` (EOS, a stop token id or a stop string) or ``length`` (max_tokens or
the model's context). A request the engine refused (``error``) or the server ended (shutdown,
engine failure) is answered with an OpenAI error object: the whole response before streaming
starts, a ``data: {"error": ...}`` event after. A client that went away is sent nothing.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from corelib.server.events import Update
from corelib.server.inputs import Prepared, token_text
from corelib.server.protocol import ApiError, JsonObject

FINISH_REASONS = {"stop": "stop", "length": "length"}


def failure(update: Update) -> ApiError | None:
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
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    _templates: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # per choice: a chunk around its text

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

    def text(self, update: Update) -> str:
        return update.text if self.has_tokenizer else token_text(update.token_ids)

    def final_text(self, update: Update) -> str:
        output = update.output
        if output is None:
            return ""
        return (output.text or "") if self.has_tokenizer else token_text(output.output_token_ids)

    # ------------------------------------------------------------------ whole responses
    def response(self, finals: list[Update]) -> JsonObject:
        choices: list[JsonObject] = []
        completion_tokens = 0
        for index, update in enumerate(finals):
            output = update.output
            assert output is not None, "a failed choice is answered with an error, not a response"
            completion_tokens += len(output.output_token_ids)
            reason = FINISH_REASONS[output.finish_reason]
            if self.chat:
                message = {"role": "assistant", "content": self.final_text(update)}
                choices.append({"index": index, "message": message, "logprobs": None, "finish_reason": reason})
            else:
                choices.append({"index": index, "text": self.final_text(update), "logprobs": None,
                                "finish_reason": reason})
        return {**self._head(chunk=False), "choices": choices, "usage": self.usage(completion_tokens)}

    # ------------------------------------------------------------------ streaming
    def _chunk(self, index: int, text: str | None, reason: str | None, role: bool = False) -> bytes:
        choice: JsonObject
        if self.chat:
            delta: JsonObject = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
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

    async def stream(self, request_ids: list[str], updates: AsyncIterator[Update]) -> AsyncIterator[bytes]:
        """SSE events until every choice finished, then the usage (when asked for) and ``[DONE]``."""
        index = {request_id: i for i, request_id in enumerate(request_ids)}
        if self.chat:
            for i in range(len(request_ids)):
                yield self._chunk(i, None, None, role=True)
        completion_tokens = 0
        async for update in updates:
            i = index[update.request_id]
            problem = failure(update) if update.finished else None
            if problem is not None:
                yield event(problem.body())
                yield DONE
                return
            text = self.text(update)
            if update.output is not None:
                completion_tokens += len(update.output.output_token_ids)
                yield self._chunk(i, text, FINISH_REASONS[update.output.finish_reason])
            elif text:
                yield self._text_chunk(i, text)
        if self.include_usage:
            yield event({**self._head(chunk=True), "choices": [], "usage": self.usage(completion_tokens)})
        yield DONE


def event(body: JsonObject) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
