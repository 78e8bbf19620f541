"""Chat templates: a conversation rendered to the prompt text the model was trained on.

Rendered the way Hugging Face transformers renders ``apply_chat_template``: Jinja2 in an
immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``, the loop-controls extension,
``raise_exception`` and ``strftime_now`` as globals, a ``tojson`` that keeps non-ASCII text,
and the variables ``messages``, ``add_generation_prompt=True``, ``bos_token`` and
``eos_token``. The rendered text holds its special tokens already, so it is encoded without
adding any (the server does that).

The template comes from ``server.chat_template`` (a file), else the checkpoint's
``chat_template.jinja``, else the ``chat_template`` of its ``tokenizer_config.json`` (a string,
or a list of named templates of which ``default`` is used). A model without one (random
weights, or a checkpoint without a template) gets :data:`FALLBACK_TEMPLATE`: one
``role: content`` line per message, then ``assistant:``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from corelib.errors import ConfigError
from corelib.trust.files import read_json, read_text

FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"


class ChatTemplateError(Exception):
    """The template refused the conversation (its ``raise_exception``), failed while rendering it, or went over
    its budget (time, memory, the length of its text)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


MAX_INDENT = 64  # tojson's indent: enough for any template, and no gigabyte of spaces per line


def _tojson(value: object, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    width = len(indent) if isinstance(indent, str) else indent
    if width is not None and not 0 <= width <= MAX_INDENT:
        raise jinja2.exceptions.TemplateError(f"tojson(indent={indent!r}): the indent must be 0 to {MAX_INDENT}")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    # Not optimized: Jinja's optimizer evaluates constant expressions while it compiles; the compiler
    # itself still joins constant output, which is why only the renderer processes compile.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
                                        optimized=False)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: object) -> str:
    """``bos_token`` as tokenizer_config.json writes it: a string, or an added-token record."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return ""


class ChatTemplate:
    """A compiled chat template and the special-token strings it may use."""

    def __init__(self, source: str, origin: str, bos_token: str = "", eos_token: str = "",
                 setting: str = "server.chat_template") -> None:
        self.source = source
        self.origin = origin  # where it came from, said once at start
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._environment = _environment()
        self._template: jinja2.Template | None = None
        try:
            self._environment.parse(source)  # the syntax only: nothing is evaluated
        except jinja2.TemplateSyntaxError as error:
            raise ConfigError(f"the chat template from {origin} does not compile: {error.message} "
                              f"(line {error.lineno}); fix it or pass another with {setting}=FILE") from None

    def compiled(self) -> jinja2.Template:
        """The template, compiled on first use.

        Compiling evaluates constant output ('x'|center(10**9) becomes a gigabyte of text), so the
        server never compiles a checkpoint's template in its own process: its renderer processes do, under
        their memory and time limits (:mod:`corelib.server.render`).
        """
        if self._template is None:
            try:
                self._template = self._environment.from_string(self.source)
            except jinja2.TemplateSyntaxError as error:
                raise ChatTemplateError(f"the chat template does not compile: {error.message}") from None
            except Exception as error:  # noqa: BLE001 - MemoryError, RecursionError: the template's own
                raise ChatTemplateError(f"the chat template cannot be compiled: {type(error).__name__}: "
                                        f"{' '.join(str(error).split())[:300]}") from None
        return self._template

    @classmethod
    def load(cls, model_path: str | None, override: str | None = None,
             setting: str = "server.chat_template") -> ChatTemplate:
        """The template of ``override``, else of the checkpoint at ``model_path``, else the fallback.

        ``setting``: how the caller names ``override`` (the server's key, or a keyword of the Python API), in
        where the template came from and in how to pass another.
        """
        settings: Mapping[str, object] = {}
        directory = Path(model_path).expanduser() if model_path else None
        if directory is not None and (directory / TOKENIZER_CONFIG).exists():
            settings = _read_json(directory / TOKENIZER_CONFIG)
        tokens = {name: _token_text(settings.get(name)) for name in ("bos_token", "eos_token")}
        if override:
            path = Path(override).expanduser()
            return cls(read_text(path, setting), f"{setting}={override}", **tokens, setting=setting)
        if directory is not None and (directory / TEMPLATE_FILE).exists():
            return cls(read_text(directory / TEMPLATE_FILE, "the chat template"), str(directory / TEMPLATE_FILE),
                       **tokens, setting=setting)
        found = _named_template(settings.get("chat_template"))
        if found is not None and directory is not None:
            return cls(found, str(directory / TOKENIZER_CONFIG), **tokens, setting=setting)
        return cls(FALLBACK_TEMPLATE, "the built-in fallback (role: content lines)", **tokens, setting=setting)

    @property
    def is_fallback(self) -> bool:
        return self.source == FALLBACK_TEMPLATE

    def render(self, messages: Sequence[Mapping[str, object]], max_chars: int | None = None,
               kwargs: Mapping[str, object] | None = None) -> str:
        """The prompt text of a conversation, ending where the assistant's answer starts.

        ``kwargs`` are more variables for the template (a request's ``chat_template_kwargs``, such as
        Qwen3's ``enable_thinking``), as transformers passes its extra keywords; they may replace
        ``add_generation_prompt`` and the token strings, never ``messages`` (:func:`check_template_kwargs`).

        Any failure of the template (its own ``raise_exception``, a recursion, a range or a string
        too large for memory) is a ChatTemplateError; so is text beyond ``max_chars``, found as it is
        produced. A checkpoint's template can still loop for as long as it likes: the server renders it
        in a process of its own, with a time and memory budget (:mod:`corelib.server.render`).
        """
        pieces: list[str] = []
        length = 0
        try:
            variables: dict[str, object] = {"add_generation_prompt": True, "bos_token": self.bos_token,
                                            "eos_token": self.eos_token, **check_template_kwargs(kwargs or {})}
            for piece in self.compiled().generate(messages=list(messages), **variables):
                length += len(piece)
                if max_chars is not None and length > max_chars:
                    raise ChatTemplateError(f"the chat template wrote more than {max_chars} characters for these "
                                            "messages, more than the model's context can hold")
                pieces.append(piece)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as error:
            raise ChatTemplateError(str(error)) from None
        except Exception as error:  # noqa: BLE001 - whatever a template raises (RecursionError, MemoryError) is its own
            raise ChatTemplateError(f"the chat template failed on these messages: {type(error).__name__}: "
                                    f"{' '.join(str(error).split())[:300]}") from None
        return "".join(pieces)


RESERVED_KWARGS = frozenset({"messages"})  # the conversation itself is the request's, not a template variable


def check_template_kwargs(kwargs: Mapping[str, object]) -> Mapping[str, object]:
    """``kwargs`` if the template may take them as variables; else ValueError naming the key and what is allowed."""
    for key in kwargs:
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"chat_template_kwargs.{key}: a template variable is named by an identifier "
                             "(letters, digits and _)")
        if key in RESERVED_KWARGS:
            raise ValueError(f"chat_template_kwargs.{key}: the conversation is passed as messages, not as a "
                             "template variable; leave it out")
    return kwargs


def _read_json(path: Path) -> Mapping[str, object]:
    data = read_json(path, "the tokenizer's settings")  # a regular file, bounded, never a FIFO
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def _named_template(value: object) -> str | None:
    """tokenizer_config.json's chat_template: a string, or ``[{"name": ..., "template": ...}]`` (``default`` wins)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {str(t.get("name")): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default", next(iter(named.values()), None))
        return chosen if isinstance(chosen, str) else None
    return None
