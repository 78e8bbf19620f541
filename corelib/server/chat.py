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

FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"


class ChatTemplateError(Exception):
    """The template refused the conversation (its ``raise_exception``) or failed while rendering it."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
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

    def __init__(self, source: str, origin: str, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        self.origin = origin  # where it came from, said once at start
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ConfigError(f"the chat template from {origin} does not compile: {error.message} "
                              f"(line {error.lineno}); fix it or pass another with server.chat_template=FILE") from None

    @classmethod
    def load(cls, model_path: str | None, override: str | None = None) -> ChatTemplate:
        """The template of ``override``, else of the checkpoint at ``model_path``, else the fallback."""
        settings: Mapping[str, object] = {}
        directory = Path(model_path).expanduser() if model_path else None
        if directory is not None and (directory / TOKENIZER_CONFIG).is_file():
            settings = _read_json(directory / TOKENIZER_CONFIG)
        tokens = {name: _token_text(settings.get(name)) for name in ("bos_token", "eos_token")}
        if override:
            path = Path(override).expanduser()
            try:
                return cls(path.read_text(), f"server.chat_template={override}", **tokens)
            except OSError as error:
                raise ConfigError(f"server.chat_template={override} cannot be read: {error.strerror}") from None
        if directory is not None and (directory / TEMPLATE_FILE).is_file():
            return cls((directory / TEMPLATE_FILE).read_text(), str(directory / TEMPLATE_FILE), **tokens)
        found = _named_template(settings.get("chat_template"))
        if found is not None and directory is not None:
            return cls(found, str(directory / TOKENIZER_CONFIG), **tokens)
        return cls(FALLBACK_TEMPLATE, "the built-in fallback (role: content lines)", **tokens)

    @property
    def is_fallback(self) -> bool:
        return self.source == FALLBACK_TEMPLATE

    def render(self, messages: Sequence[Mapping[str, object]]) -> str:
        """The prompt text of a conversation, ending where the assistant's answer starts."""
        try:
            return self._template.render(
                messages=list(messages), add_generation_prompt=True, bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as error:
            raise ChatTemplateError(str(error)) from None
        except (TypeError, ValueError, KeyError, AttributeError) as error:
            raise ChatTemplateError(f"the chat template failed on these messages: {error}") from None


def _read_json(path: Path) -> Mapping[str, object]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path} cannot be read as JSON: {error}") from None
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
