"""The OpenAI request bodies the server accepts, and its error shape.

Bodies are validated here, before anything reaches the engine: a wrong type or value is a 400
whose ``param`` names the field, never a 500. Types are strict, as JSON has them: ``"5"``, ``true``
and ``5.0`` are not the integer 5. A body that is not JSON Python can hold (nested beyond
:data:`corelib.trust.files.MAX_JSON_DEPTH`, an integer of thousands of digits, a lone UTF-16 surrogate
in a string) is a 400 too. The sampling parameters are not named here: every field of
:class:`corelib.SamplingParams` the server offers (``API_FIELDS``: temperature, top_p, top_k, the
penalties, seed, stop, n, ...) is taken from the body by its own name and checked by
``SamplingParams`` itself (:mod:`corelib.server.inputs`), so a new sampler option reaches the
server without a line here (``logprobs`` is mapped by hand: completions take a count, chat a
flag and ``top_logprobs``). Parameters of the OpenAI API that this server does not implement
are refused by name when they ask for something (``best_of: 2``) and accepted when they hold
their neutral value (``best_of: 1``), so ordinary clients work.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Mapping
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, PrivateAttr, ValidationError

from corelib.sampling_params import API_FIELDS, MAX_LOGPROBS
from corelib.support.structured import StructuredOutputsError, from_response_format

JsonObject = dict[str, object]


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> JsonObject:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False  # a last chunk with the usage of the whole request


class _Sampling(BaseModel):
    """Fields common to completions and chat; the sampling parameters travel in ``sampling``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    _sampling: dict[str, object] = PrivateAttr(default_factory=dict)

    @property
    def sampling(self) -> dict[str, object]:
        """The body's SamplingParams fields (API_FIELDS), as sent; null ones left out."""
        return self._sampling

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


TokenIds = list[int]


Prompt = str | list[str] | TokenIds | list[TokenIds]


def _prompt(value: object) -> Prompt:
    """A prompt's shape in one pass: pydantic's union would validate a long list against every member first
    (a million token ids: half a minute of errors collected and dropped)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        kinds = set(map(type, value))  # at C speed: a body's worth of ids costs milliseconds
        if kinds <= {int} or kinds == {str}:
            return value
        if kinds == {list} and set(map(type, itertools.chain.from_iterable(value))) <= {int}:
            return value
    raise ValueError("must be a string, a list of strings, a list of token ids (integers) or a list of such lists")


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. ``prompt`` is text, token ids, or a list of either (one choice set each)."""

    prompt: Annotated[Prompt, PlainValidator(_prompt)]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # each token's and the k most likely
    echo: bool = False  # the prompt's text before each choice's text

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # tool_calls, reasoning fields: passed to the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    # At most MAX_MESSAGES, holding at most MAX_CONTENT_PARTS parts: counted before they are validated.
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the model's length
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool = False  # each output token's log-probability
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # and the k most likely (needs logprobs)
    # More variables for the chat template (Qwen3's {"enable_thinking": false}), rendered within its budget.
    chat_template_kwargs: dict[str, object] | None = None

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a ``prompt`` as completions take it, or ``messages`` as chat renders them."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # None: True for a prompt; for messages, what chat does
    add_generation_prompt: bool = True  # messages: end where the assistant's answer starts
    chat_template_kwargs: dict[str, object] | None = None
    return_token_strs: bool = False  # also each token's text


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``: the text of token ids."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


# OpenAI parameters this server does not implement, with the values that ask for nothing.
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
}

Request = TypeVar("Request", CompletionRequest, ChatRequest, TokenizeRequest, DetokenizeRequest)


MAX_MESSAGES = 4096  # a conversation's messages: each costs the validator tens of microseconds
MAX_CONTENT_PARTS = 4096  # content parts over all of a conversation's messages: each costs as much as a message
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_body(raw: bytes, model: type[Request]) -> Request:
    """The body as ``model``, or an ApiError naming the first field at fault.

    Runs on the event loop, so every step costs at most a pass over the (size-limited) body: the
    parse, a surrogate search only where the body escapes one, a count of messages before they are
    validated, and strict validation without unions over long lists.
    """
    try:
        data = json.loads(raw)
    except RecursionError:
        raise bad_request("the request body is nested too deeply to parse") from None
    except ValueError as error:  # not JSON, not UTF-8, or an integer of thousands of digits
        raise bad_request(f"the request body is not valid JSON: {' '.join(str(error).split())[:200]}") from None
    where = _lone_surrogate(data) if _SURROGATE_ESCAPE.search(raw) else None  # only an escape makes one
    if where is not None:
        raise bad_request(f"{where}: holds a lone UTF-16 surrogate, which is no character; send text as UTF-8 or "
                          "as escaped pairs", where)
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, not {type(data).__name__}")
    messages = data.get("messages")
    if isinstance(messages, list):
        if len(messages) > MAX_MESSAGES:
            raise bad_request(f"messages: {len(messages)} messages; this server takes at most {MAX_MESSAGES}",
                              "messages")
        parts = sum(len(content) for message in messages if isinstance(message, dict)
                    and isinstance(content := message.get("content"), list))
        if parts > MAX_CONTENT_PARTS:
            raise bad_request(f"messages: {parts} content parts; this server takes at most {MAX_CONTENT_PARTS} in "
                              "one conversation (join text parts into one string)", "messages")
    sampling = {key: data.pop(key) for key in API_FIELDS if key in data} if issubclass(model, _Sampling) else {}
    for key, neutral in _NEUTRAL.items() if issubclass(model, _Sampling) else ():
        if key not in data:
            continue
        value = data.pop(key)
        if value is not None and not any(value == n and type(value) is type(n) for n in neutral):
            raise bad_request(f"{key}={json.dumps(value)} is not supported by this server; leave it out", key)
    if "response_format" in data and issubclass(model, _Sampling):  # JSON mode: the grammar is checked later,
        try:  # off the event loop (corelib.server.inputs)
            structured = from_response_format(data.pop("response_format"))
        except StructuredOutputsError as error:
            raise bad_request(str(error), "response_format") from None
        if structured is not None:
            sampling["structured_outputs"] = structured
    try:
        request = model.model_validate(data)
    except ValidationError as error:
        raise _explain(error) from None
    if isinstance(request, _Sampling):
        request._sampling = {key: value for key, value in sampling.items() if value is not None}
    return request


def _lone_surrogate(data: object) -> str | None:
    """Where a string of ``data`` holds a code point of U+D800..U+DFFF (JSON's ``\\ud800`` alone), if one does."""
    stack: list[tuple[object, str]] = [(data, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(node, dict):
            stack.extend((value, f"{path}.{key}" if path else str(key)) for key, value in node.items())
            if any(isinstance(key, str) and _lone_surrogate(key) for key in node):
                return path or "body"
        elif isinstance(node, list):
            stack.extend((value, f"{path}.{index}" if path else str(index)) for index, value in enumerate(node))
    return None


_BASIC_TYPES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_union_tag(part: str) -> bool:
    """Pydantic names the member of a union that failed (``str``, ``list[int]``) in the error's path."""
    return "[" in part or part in _BASIC_TYPES


def _explain(error: ValidationError) -> ApiError:
    first = error.errors(include_url=False)[0]
    where = [str(part) for part in first["loc"] if not _is_union_tag(str(part))]
    param = ".".join(where) or None
    if first["type"] == "extra_forbidden":
        return bad_request(f"{param}: not a parameter this server accepts", param)
    if first["type"] == "missing":
        return bad_request(f"{param}: this parameter is required", param)
    if param is not None and param.split(".")[0] == "prompt":
        return bad_request(
            "prompt: must be a string, a list of strings, a list of token ids (integers) or a list of such lists",
            "prompt",
        )
    given = first.get("input")
    shown = "" if isinstance(given, Mapping | list) else f" (got {json.dumps(given, default=str)})"
    return bad_request(f"{param}: {first['msg']}{shown}", param)
