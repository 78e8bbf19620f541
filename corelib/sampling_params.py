"""How a request samples and stops, and why it ended: the one ``SamplingParams`` of the engine, ``corelib.LLM`` and the
server, and its ``FinishReason``.

Torch-free: the HTTP process builds these. Every per-request value the device reads is a
*sampler column*: a field whose metadata (:class:`Column`) gives its device dtype, its neutral
value (padded rows hold it; it changes nothing) and example values for the op conformance
case. :data:`corelib.ops.spec.SAMPLING_COLUMNS` is derived from these fields, the OpenAI
server accepts each field under its own name (:data:`API_FIELDS`), and every value is
checked here against what its column can hold. So a new sampler option is a field here, a
field of ``SamplingInputs`` and its math in ``corelib/ops/sampling.py``.

Names and meanings follow vLLM's ``SamplingParams``; the one difference is the default
temperature: 0 (greedy), where vLLM's is 1 (``LLM.generate`` without params and the server's
requests that leave it out do use 1, under the checkpoint's generation_config.json).
``logit_bias`` and ``min_tokens``' ban on the stop ids are not scalars: each row carries a table
of a fixed width (``LOGIT_BIAS_WIDTH``, ``MIN_TOKENS_STOP_WIDTH``,
:data:`corelib.ops.spec.SAMPLING_TABLES`) in every step's inputs.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from corelib.errors import RequestError
from corelib.support.structured import StructuredOutputsError, StructuredOutputsParams

FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32
INT64_LIMIT = 2**63
SEED_LIMIT = 2**62  # the counter-based sampler takes seeds in [0, 2**62)
MAX_LOGPROBS = 20  # the most alternatives a token's logprobs list (OpenAI's top_logprobs bound)
# Stop strings are matched on the host after every token of their request, each against the end of
# its text: the work per token grows with their count and their lengths. OpenAI takes at most 4 and
# TGI 4 by default; vLLM sets no bound, and its clients send a few short ones ("\n\n", "</s>",
# "User:"). 16 times OpenAI's count, each as long as a paragraph, is far beyond any of those, and
# keeps a request's check to some 32,000 characters compared per token at the very worst.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 512
# logit_bias travels to the device as a table of (token id, bias) of this width in every step's inputs
# (12 bytes an entry, a row's table copied each step whatever its use). OpenAI's examples bias or ban
# a handful of tokens; 64 is many times that at some 770 bytes a row. Each bias is bounded as OpenAI
# bounds it: [-100, 100] (-100 bans a token, 100 all but forces it).
LOGIT_BIAS_WIDTH = 64
MAX_LOGIT_BIAS = 100.0
# min_tokens bans a request's stop ids (its stop_token_ids and, unless ignore_eos, the model's EOS ids)
# until it has that many tokens: the device holds them in a table of this width; the request's own
# stop_token_ids may take all but 8 places (left for the EOS ids of the model's generation config).
MIN_TOKENS_STOP_WIDTH = 32
MAX_MIN_TOKENS_STOP_IDS = MIN_TOKENS_STOP_WIDTH - 8


class FinishReason(str, enum.Enum):
    """Why a request ended: what its stops and its length allow, or what happened to it."""

    stop = "stop"  # EOS, a stop token id or a stop string
    length = "length"  # max_tokens or the model's maximum length
    error = "error"  # the request was invalid or its work failed
    cancelled = "cancelled"  # the engine shut down first
    abort = "abort"  # the caller aborted it (Engine.abort, or a client that went away)


class SamplingError(RequestError, ValueError):
    """A sampling value that cannot be used; ``field`` names it (the server's ``param``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[type[SamplingError], tuple[str, str]]:
        return SamplingError, (self.field, str(self))


@dataclass(frozen=True)
class Column:
    """A field the device reads, one value per row of a step (``SAMPLING_COLUMNS`` is built from these)."""

    dtype: str  # "float32" or "int64": the column's device dtype, which bounds the values accepted
    neutral: float  # the value that changes nothing (padded rows hold it)
    examples: tuple[float, ...] = ()  # values the op conformance case cycles through rows; empty: random ints
    name: str = ""  # the column's name where it differs from the field's
    selects: bool = True  # a value other than neutral needs the sampler (a seed only keys its noise)


Rule = tuple[Callable[[Any], bool], str]  # a test of the value, and what to say when it fails


def _meta(rule: Rule | None = None, column: Column | None = None, api: bool = True,
          api_default: object = dataclasses.MISSING) -> dict[str, object]:
    return {"rule": rule, "column": column, "api": api, "api_default": api_default}


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request samples and when it stops; a bad value raises :class:`SamplingError` (a ValueError) here.

    Greedy by default (``temperature=0``). ``seed=None`` draws a fresh seed for the request;
    a seed given makes its samples repeatable whatever batch it shares. ``stop`` is a string
    or a list of strings: the text ends before the first one found (needs a tokenizer). ``n``
    asks ``LLM.generate`` (and the server) for that many samples of each prompt.
    """

    n: int = field(default=1, metadata=_meta((lambda v: v >= 1, "must be at least 1")))
    presence_penalty: float = field(default=0.0, metadata=_meta(
        (lambda v: -2 <= v <= 2, "must be in [-2, 2]"), Column("float32", 0.0, (0.0, 0.5, -0.5, 2.0))))
    frequency_penalty: float = field(default=0.0, metadata=_meta(
        (lambda v: -2 <= v <= 2, "must be in [-2, 2]"), Column("float32", 0.0, (0.0, 0.3, 1.0, -1.0))))
    repetition_penalty: float = field(default=1.0, metadata=_meta(
        (lambda v: v > 0, "must be > 0 (1: none)"), Column("float32", 1.0, (1.0, 1.3, 0.8, 2.0))))
    temperature: float = field(default=0.0, metadata=_meta(
        (lambda v: v >= 0, "must be a finite number >= 0 (0: greedy)"), Column("float32", 0.0, (0.0, 0.7, 1.0, 1.5)),
        api_default=1.0))  # OpenAI's default
    top_p: float = field(default=1.0, metadata=_meta(
        (lambda v: 0 < v <= 1, "must be in (0, 1]"), Column("float32", 1.0, (1.0, 0.9, 0.5, 1.0))))
    top_k: int = field(default=0, metadata=_meta(
        (lambda v: v >= 0, "must be >= 0 (0 or -1: no cut)"), Column("int64", 0, (0, 50, 0, 10))))
    # Tokens whose probability is below min_p times the likeliest one's are cut (after temperature); 0: none.
    min_p: float = field(default=0.0, metadata=_meta(
        (lambda v: 0 <= v <= 1, "must be in [0, 1]"), Column("float32", 0.0, (0.0, 0.1, 0.05, 0.3))))
    # The stop ids (stop_token_ids, and EOS unless ignore_eos) cannot be sampled before this many tokens;
    # stop strings count only after them.
    min_tokens: int = field(default=0, metadata=_meta(
        (lambda v: 0 <= v < INT64_LIMIT, "must be >= 0"), Column("int64", 0, (0, 3, 0, 1))))
    seed: int | None = field(default=None, metadata=_meta(
        (lambda v: v is None or 0 <= v < SEED_LIMIT, "must be in [0, 2**62)"),
        Column("int64", 0, name="seeds", selects=False)))
    stop: str | Sequence[str] | None = None  # stored as a tuple of strings
    stop_token_ids: Sequence[int] = ()  # stored as a tuple
    ignore_eos: bool = False
    # None: up to the end of the model's context (max_model_len less the prompt).
    max_tokens: int | None = field(default=16, metadata=_meta(
        (lambda v: v is None or v >= 1, "must be at least 1 (None: to the end of the context)"), api=False))
    # token id -> a bias added to its logit before anything else (OpenAI's logit_bias: JSON's string keys
    # are token ids too); at most LOGIT_BIAS_WIDTH entries, each in [-100, 100]. Stored as a dict.
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)
    include_stop_str_in_output: bool = False  # the text ends after the stop string that ended it, not before
    skip_special_tokens: bool = True  # the output text leaves special tokens out
    detokenize: bool = True  # False: no text (token ids only); stop strings need text
    # Each output token's log-probability and the ``logprobs`` most likely ones (OpenAI's completions
    # ``logprobs``, chat's ``top_logprobs``: the server maps them itself); None: none.
    logprobs: int | None = field(default=None, metadata=_meta(
        (lambda v: v is None or 0 <= v <= MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}] or None"), api=False))
    # Each prompt token's log-probability given the tokens before it, its rank, and the ``prompt_logprobs`` most
    # likely tokens at its place (vLLM's; the first token has none); None: none. Such a request computes its whole
    # prompt: it takes no blocks from the prefix cache (vLLM turns prefix caching off for it). The server takes it
    # by name and also asks it for completions' echo with logprobs (corelib.server.inputs).
    prompt_logprobs: int | None = field(default=None, metadata=_meta(
        (lambda v: v is None or 0 <= v <= MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}] or None")))
    # The output must be JSON of this schema (vLLM's StructuredOutputsParams, or a mapping of its fields): a
    # grammar masks every sampled token on the device (the server maps OpenAI's response_format to it).
    structured_outputs: StructuredOutputsParams | Mapping[str, Any] | None = field(  # stored as the params
        default=None, metadata=_meta(api=False))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _normalized(f, getattr(self, f.name)))
        for f in dataclasses.fields(self):
            value, rule, column = getattr(self, f.name), f.metadata.get("rule"), f.metadata.get("column")
            if rule is not None and value is not None and not (_finite(value) and rule[0](value)):
                raise SamplingError(f.name, f"{f.name}={value!r}: {rule[1]}")
            if isinstance(column, Column) and value is not None:
                _check_column(f.name, value, column)
        if "" in self.stop_strings:
            raise SamplingError("stop", "stop: an empty string would stop every request at its first token")
        long = [i for i, stop in enumerate(self.stop_strings) if len(stop) > MAX_STOP_CHARS]
        if long:
            raise SamplingError("stop", f"stop[{long[0]}] has {len(self.stop_strings[long[0]])} characters: each stop "
                                        f"string must be at most {MAX_STOP_CHARS} (each is matched after every token)")
        if self.stop_strings and not self.detokenize:
            raise SamplingError("stop", "stop: stop strings are matched in the text, which detokenize=False leaves "
                                        "out; use stop_token_ids, or detokenize=True")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingError("min_tokens", f"min_tokens={self.min_tokens}: must be at most "
                                              f"max_tokens={self.max_tokens}")
        if self.min_tokens and len(self.stop_token_ids) > MAX_MIN_TOKENS_STOP_IDS:
            raise SamplingError("stop_token_ids", f"stop_token_ids: {len(self.stop_token_ids)} ids with min_tokens: "
                                                  f"at most {MAX_MIN_TOKENS_STOP_IDS} (the device bans each until "
                                                  "min_tokens)")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings, checked on the host (steps holding such a request run synchronously)."""
        return tuple(self.stop or ())

    @property
    def needs_sampler(self) -> bool:
        """Some column asks for more than the greedy argmax (temperature, a cut, a penalty)."""
        return bool(self.logit_bias) or any(
            column.selects and getattr(self, param) != column.neutral for param, column in columns())

    def validate(self, vocab_size: int) -> None:
        """Raise a SamplingError naming what the model's vocabulary refuses."""
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise SamplingError("stop_token_ids",
                                f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {vocab_size})")
        bad = [t for t in self.logit_bias or () if not 0 <= t < vocab_size]
        if bad:
            raise SamplingError("logit_bias", f"logit_bias: token id {bad[0]} is outside the vocabulary "
                                              f"[0, {vocab_size})")

    def replace(self, **changes: object) -> SamplingParams:
        """A copy with ``changes``, checked like a new one."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_mapping(cls, values: Mapping[str, object]) -> SamplingParams:
        """Built from field names (a request body's), each value checked; an unknown name is a SamplingError."""
        known = {f.name for f in dataclasses.fields(cls)}
        for name in values:
            if name not in known:
                raise SamplingError(name, f"{name}: not a sampling parameter")
        return cls(**dict(values))  # type: ignore[arg-type]


def columns() -> tuple[tuple[str, Column], ...]:
    """(field name, Column) of every sampler column, in field order."""
    return _COLUMNS


def api_default(name: str) -> object:
    """The value the OpenAI server uses when a request leaves field ``name`` out."""
    f = _FIELDS[name]
    given = f.metadata.get("api_default", dataclasses.MISSING)
    return f.default if given is dataclasses.MISSING else given


def choices(params: SamplingParams, first: int = 0) -> list[SamplingParams]:
    """The ``n`` single-sample requests that stand for ``params``: choice ``i`` samples with ``seed + first + i``.

    With ``seed=None`` each choice draws its own. The one place ``n`` becomes requests, so
    samples that share the prompt's KV blocks can replace it.
    """
    if params.n == 1 and (params.seed is None or first == 0):
        return [params]  # the one request it stands for: itself (a seed is below SEED_LIMIT already)
    if params.seed is None:
        return [params.replace(n=1)] * params.n
    return [params.replace(n=1, seed=(params.seed + first + i) % SEED_LIMIT) for i in range(params.n)]


# ---------------------------------------------------------------------------------- checks


def _finite(value: object) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def _check_column(name: str, value: float, column: Column) -> None:
    if column.dtype == "float32" and abs(value) > FLOAT32_MAX:
        raise SamplingError(name, f"{name}={value!r}: must be at most {FLOAT32_MAX:.6g} (the device holds it "
                                  "as float32)")
    if column.dtype == "int64" and not -INT64_LIMIT <= value < INT64_LIMIT:
        raise SamplingError(name, f"{name}={value!r}: must be below 2**63 (the device holds it as int64)")


def _normalized(f: dataclasses.Field[Any], value: object) -> object:
    """``value`` as the plain Python type of field ``f`` (numpy and other number types included)."""
    name, kind = f.name, f.type
    if name == "structured_outputs":
        try:
            return None if value is None else StructuredOutputsParams.of(value, name)
        except StructuredOutputsError as error:
            raise SamplingError(error.field, str(error)) from None
    if name == "stop":
        if value is None or isinstance(value, str):
            return () if value is None else (value,)
        if isinstance(value, Sequence) and len(value) > MAX_STOP_STRINGS:  # counted before anything is done with them
            raise SamplingError(name, f"stop: {len(value)} stop strings: at most {MAX_STOP_STRINGS} (each is matched "
                                      "after every token)")
        return _strings(name, value)
    if name == "logit_bias":
        return _logit_bias(value)
    if name == "stop_token_ids":
        if isinstance(value, str) or not isinstance(value, Sequence | tuple | list):
            raise SamplingError(name, f"{name}={value!r}: pass a list of token ids")
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in value):
            raise SamplingError(name, f"{name}={list(value)!r}: token ids must be integers")
        return tuple(operator.index(t) for t in value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise SamplingError(name, f"{name}={value!r}: must be true or false, not {type(value).__name__}")
        return value
    if value is None and "None" in str(kind):
        return None
    if "int" in str(kind):
        number = _integer(name, value)
        return 0 if name == "top_k" and number == -1 else number  # -1: vLLM's word for no cut
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise SamplingError(name, f"{name}={value!r}: must be a number, not {type(value).__name__}")
    return float(value)


def _logit_bias(value: object) -> dict[int, float] | None:
    """``value`` as {token id: bias}; keys may be integers or their decimal strings (JSON's object keys)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise SamplingError("logit_bias", f"logit_bias={_short(value)}: pass a mapping of token id to bias")
    if len(value) > LOGIT_BIAS_WIDTH:
        raise SamplingError("logit_bias", f"logit_bias: {len(value)} entries: at most {LOGIT_BIAS_WIDTH} (the "
                                          "device carries them in a table of that width)")
    bias: dict[int, float] = {}
    for key, number in value.items():
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            token = int(key)
        elif isinstance(key, numbers.Integral) and not isinstance(key, bool):
            token = operator.index(key)
        else:
            raise SamplingError("logit_bias", f"logit_bias: key {_short(key)} is not a token id")
        given = float(number) if isinstance(number, numbers.Real) and not isinstance(number, bool) else math.nan
        if not abs(given) <= MAX_LOGIT_BIAS:  # NaN and infinities included
            raise SamplingError("logit_bias", f"logit_bias[{token}]={_short(number)}: must be a number in "
                                              f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if token in bias:
            raise SamplingError("logit_bias", f"logit_bias: token id {token} is given twice")
        bias[token] = given
    return bias


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SamplingError(name, f"{name}={value!r}: must be an integer, not {type(value).__name__}")
    return operator.index(value)


def _strings(name: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, Sequence) or not all(isinstance(s, str) for s in value):
        raise SamplingError(name, f"{name}={_short(value)}: pass a string or a list of strings")
    return tuple(value)


def _short(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error is one line, whatever a client sent."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


_FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}
_COLUMNS = tuple(
    (f.name, f.metadata["column"]) for f in _FIELDS.values() if isinstance(f.metadata.get("column"), Column)
)
#: the fields the OpenAI server takes from a request body by their own names (``max_tokens`` is its own)
API_FIELDS = tuple(f.name for f in _FIELDS.values() if f.metadata.get("api", True))
