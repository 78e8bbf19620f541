"""What output a request's structure must take: vLLM's ``StructuredOutputsParams``, torch-free.

The HTTP process builds these (from ``response_format``) as part of a ``SamplingParams``; the
engine compiles them into a grammar (:mod:`corelib.engine.structured`) whose matcher masks the
logits of every token the request samples. A schema is kept as compact JSON text (its properties
in their order: the output follows it): it is hashable, it travels to the engine process as it is, and
requests with the same schema, whatever its spacing, share one compiled grammar.

Only ``json`` (a JSON schema) and ``json_object`` (any JSON object) are supported; each other
option of vLLM's is refused in one line naming it.
"""

from __future__ import annotations

import json as jsonlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from corelib.errors import RequestError

# A schema is compiled on the host, once per distinct schema; typical ones are a few hundred characters.
# 64 KiB is far beyond any hand-written one and bounds what a client can make the compiler chew on.
MAX_SCHEMA_CHARS = 65536
#: vLLM's options that corelib does not support (each refused by name)
UNSUPPORTED = ("regex", "choice", "grammar", "structural_tag")
ANY_OBJECT = '{"type":"object"}'  # json_object: any JSON object


class StructuredOutputsError(RequestError, ValueError):
    """A structured-output request that cannot be served; ``field`` names the option at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[type[StructuredOutputsError], tuple[str, str]]:
        return StructuredOutputsError, (self.field, str(self))


@dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams``: ``json`` (a JSON schema, as a dict or its text) or ``json_object=True``.

    Exactly one of them. ``json`` is stored as compact JSON text. ``disable_any_whitespace``
    is accepted for vLLM's sake: outputs are always compact (no whitespace between tokens of the
    JSON), which keeps a small model from spending its tokens on spaces.
    """

    json: str | Mapping[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        for name in UNSUPPORTED:
            if getattr(self, name) is not None:
                raise StructuredOutputsError(
                    f"structured_outputs.{name}", f"structured_outputs.{name}: not supported; use json (a JSON "
                                                  "schema) or json_object=True")
        if self.json_object not in (None, True, False):
            raise StructuredOutputsError("structured_outputs.json_object",
                                         f"structured_outputs.json_object={self.json_object!r}: must be true")
        if (self.json is None) == (not self.json_object):
            raise StructuredOutputsError("structured_outputs", "structured_outputs: give exactly one of json (a JSON "
                                                               "schema) and json_object=True")
        if self.json is not None:
            object.__setattr__(self, "json", canonical_schema(self.json, "structured_outputs.json"))

    @property
    def schema(self) -> str:
        """The JSON schema the output must validate against, as compact JSON text."""
        return ANY_OBJECT if self.json is None else str(self.json)

    @property
    def key(self) -> str:
        """What the compiled grammar depends on (a cache key)."""
        return self.schema

    @classmethod
    def of(cls, value: object, field: str = "structured_outputs") -> StructuredOutputsParams:
        """``value`` as params: params themselves, or a mapping of their fields (a request body's)."""
        if isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, Mapping):
            raise StructuredOutputsError(field, f"{field}: pass an object such as {{\"json\": {{...schema...}}}}, "
                                                f"not {type(value).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise StructuredOutputsError(f"{field}.{unknown[0]}", f"{field}.{unknown[0]}: unknown option; the "
                                                                  "options are json and json_object")
        return cls(**{str(k): v for k, v in value.items()})


def canonical_schema(schema: object, field: str) -> str:
    """A JSON schema (a dict, or its text) as compact JSON text; StructuredOutputsError naming ``field``."""
    if isinstance(schema, str):
        if len(schema) > MAX_SCHEMA_CHARS:
            raise StructuredOutputsError(field, f"{field}: a schema of {len(schema)} characters; at most "
                                                f"{MAX_SCHEMA_CHARS}")
        try:
            schema = jsonlib.loads(schema)
        except (ValueError, RecursionError) as error:
            raise StructuredOutputsError(field, f"{field}: not valid JSON ({_one_line(error)})") from None
    if not isinstance(schema, Mapping):
        raise StructuredOutputsError(field, f"{field}: a JSON schema is an object, not {type(schema).__name__}")
    try:
        # The properties keep their order: the output's follows it.
        text = jsonlib.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as error:
        raise StructuredOutputsError(field, f"{field}: not a JSON value ({_one_line(error)})") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise StructuredOutputsError(field, f"{field}: a schema of {len(text)} characters; at most "
                                            f"{MAX_SCHEMA_CHARS}")
    return text


def _one_line(error: object, limit: int = 120) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else f"{text[:limit]}..."


def from_response_format(value: object) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format`` as params: None for ``{"type": "text"}``; ``{"type": "json_object"}``; or
    ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``. A
    StructuredOutputsError naming ``response_format`` (or the key within it) for anything else."""
    field = "response_format"
    if value is None:
        return None
    if not isinstance(value, Mapping) or not isinstance(value.get("type"), str):
        raise StructuredOutputsError(field, f"{field}: pass an object with a type: text, json_object or json_schema")
    kind = value["type"]
    extra = sorted(str(k) for k in value if k not in ("type", "json_schema"))
    if extra:
        raise StructuredOutputsError(f"{field}.{extra[0]}", f"{field}.{extra[0]}: unknown key; {field} takes type "
                                                            "and json_schema")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise StructuredOutputsError(f"{field}.type", f"{field}.type={_one_line(repr(kind))}: must be text, "
                                                      "json_object or json_schema")
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping):
        raise StructuredOutputsError(f"{field}.json_schema", f"{field}.json_schema: pass an object with name and "
                                                             "schema")
    unknown = sorted(str(k) for k in spec if k not in ("name", "schema", "strict", "description"))
    if unknown:
        raise StructuredOutputsError(f"{field}.json_schema.{unknown[0]}",
                                     f"{field}.json_schema.{unknown[0]}: unknown key; json_schema takes name, "
                                     "description, schema and strict")
    schema = spec.get("schema", {"type": "object"})  # OpenAI: a schema left out allows any object
    return StructuredOutputsParams(json=canonical_schema(schema, f"{field}.json_schema.schema"))
