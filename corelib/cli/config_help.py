"""``python -m corelib COMMAND --help``: the config groups, and every key with what it means.

Hydra's own help prints the composed config as bare YAML. corelib's schemas carry each key's
meaning as field metadata (``corelib.config.schema.doc``), and an enum key's type lists its values;
this renders the composed config (the user's overrides applied) with both beside each key,
between the ``hydra.help`` header and footer of ``conf/config.yaml``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import types
import typing
from collections.abc import Iterator, Sequence
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

HELP_KEY = "help"
COMMENT_COLUMN = 44  # where the meanings start, unless a key's line is longer
_PLAIN = re.compile(r"^[A-Za-z0-9_./+-][A-Za-z0-9_ ./+-]*$")


def render_help(command: str, overrides: Sequence[str]) -> str:
    """The help text of ``command`` with ``overrides`` applied to the config it shows."""
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from corelib.config.schema import register_schemas
    from corelib.startup.compose import CONFIG_NAME, hydra_context, translate_error

    register_schemas()
    with hydra_context():
        try:
            full = compose(config_name=CONFIG_NAME, overrides=[*overrides, f"hydra.job.name={command}"],
                           return_hydra_config=True)
        except Exception as error:  # noqa: BLE001 - Hydra's and OmegaConf's errors become one line
            raise translate_error(error) from None
        HydraConfig.instance().set_config(full)
        loader = GlobalHydra.instance().config_loader()
        groups = {group: sorted(loader.get_group_options(group))
                  for group in sorted(loader.list_groups("")) if group != "hydra"}
        header, footer = str(full.hydra.help.header), str(full.hydra.help.footer)
    group_lines = [f"{group}: {', '.join(options)}" for group, options in groups.items() if options]
    return "\n".join([
        header.rstrip(),
        "",
        "== Configuration groups ==",
        "Pick one option per group (group=option)",
        "",
        *group_lines,
        "",
        "== Config ==",
        "Override any key (group.key=value); after each key, its allowed values [a|b] and what it means",
        "",
        *annotated_config(full),
        "",
        footer.rstrip(),
    ])


def annotated_config(cfg: DictConfig) -> list[str]:
    """``cfg`` (less its ``hydra`` node) as YAML lines, each key followed by ``# [values] meaning``."""
    pairs = list(_lines(cfg, 0, skip=("hydra",)))
    return [_with_comment(text, meaning) for text, meaning in pairs]


def key_help(schema: type, name: str) -> str:
    """What key ``name`` of dataclass ``schema`` means, with its allowed values when it is an enum."""
    meaning = ""
    for field in dataclasses.fields(schema):
        if field.name == name:
            meaning = str(field.metadata.get(HELP_KEY, ""))
    values = _enum_values(schema, name)
    return f"[{'|'.join(values)}] {meaning}".rstrip() if values else meaning


def _with_comment(text: str, meaning: str) -> str:
    if not meaning:
        return text
    return f"{text.ljust(COMMENT_COLUMN - 2)}  # {meaning}"


def _lines(node: DictConfig, indent: int, skip: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    schema = OmegaConf.get_type(node)
    is_schema = isinstance(schema, type) and dataclasses.is_dataclass(schema)
    pad = " " * indent
    for raw_key in node:
        key = str(raw_key)
        if key in skip:
            continue
        meaning = key_help(schema, key) if is_schema and isinstance(schema, type) else ""
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing() and len(child):
            yield f"{pad}{key}:", meaning
            yield from _lines(child, indent + 2)
        elif isinstance(child, ListConfig) and not child._is_none() and any(
            isinstance(item, DictConfig) for item in child._iter_ex(resolve=False)
        ):
            yield f"{pad}{key}:", meaning
            for item in child:
                yield f"{pad}  - {_flow(item)}", ""
        else:
            yield f"{pad}{key}: {_flow(child)}", meaning


def _flow(node: Any) -> str:
    """A value in YAML flow style on one line."""
    if isinstance(node, DictConfig | ListConfig):
        if node._is_none():
            return "null"
        if node._is_missing():
            return str(MISSING)
        if isinstance(node, ListConfig):
            return "[" + ", ".join(_flow(node._get_node(i)) for i in range(len(node))) + "]"
        return "{" + ", ".join(f"{k!s}: {_flow(node._get_node(k))}" for k in node) + "}"
    value = node._value() if hasattr(node, "_value") else node
    if value is None:
        return "null"
    if isinstance(value, enum.Enum):
        return str(value.name)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return str(value)
    text = str(value)
    if text == MISSING or (_PLAIN.match(text) and text not in ("null", "true", "false") and text.strip() == text):
        return text
    return json.dumps(text, ensure_ascii=False)


def _enum_values(schema: type, name: str) -> list[str]:
    try:
        hints = typing.get_type_hints(schema)
    except (NameError, TypeError):
        return []
    hint = hints.get(name)
    candidates = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, enum.Enum):
            return [str(member.name) for member in candidate]
    return []
