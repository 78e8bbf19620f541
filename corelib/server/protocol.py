"""The OpenAI request bodies the server accepts, and its error shape.

Bodies are validated here, before anything reaches the engine: a wrong type or value is a 400
whose ``param`` names the field, never a 500. The sampling parameters are not named here: every
field of :class:`corelib.SamplingParams` the server offers (``API_FIELDS``: temperature, top_p,
top_k, the penalties, seed, stop, n, ...) is taken from the body by its own name and checked by
``SamplingParams`` itself (:mod:`corelib.server.inputs`), so a new sampler option reaches the
server without a line here (``logprobs`` is mapped by hand: completions take a count, chat a
flag and ``top_logprobs``). Parameters of the OpenAI API that this server does not implement
are refused by name when they ask for something (``echo: true``) and accepted when they hold
their neutral value (``echo: false``), so ordinary clients work.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from corelib.sampling_params import API_FIELDS, MAX_LOGPROBS

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
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False  # a last chunk with the usage of the whole request


class _Sampling(BaseModel):
    """Fields common to completions and chat; the sampling parameters travel in ``sampling``."""

    model_config = ConfigDict(extra="forbid")

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




class CompletionRequest(_Sampling):
    """``POST /v1/completions``. ``prompt`` is text, token ids, or a list of either (one choice set each)."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # each token's and the k most likely

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, reasoning fields: passed to the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the model's length
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool = False  # each output token's log-probability
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # and the k most likely (needs logprobs)

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# OpenAI parameters this server does not implement, with the values that ask for nothing.
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "echo": (False, None),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
}

Request = TypeVar("Request", CompletionRequest, ChatRequest)


def parse_body(raw: bytes, model: type[Request]) -> Request:
    """The body as ``model``, or an ApiError naming the first field at fault."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(f"the request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, not {type(data).__name__}")
    sampling = {key: data.pop(key) for key in API_FIELDS if key in data}
    for key, neutral in _NEUTRAL.items():
        if key not in data:
            continue
        value = data.pop(key)
        if value is not None and not any(value == n and type(value) is type(n) for n in neutral):
            raise bad_request(f"{key}={json.dumps(value)} is not supported by this server; leave it out", key)
    try:
        request = model.model_validate(data)
    except ValidationError as error:
        raise _explain(error) from None
    request._sampling = {key: value for key, value in sampling.items() if value is not None}
    return request


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
