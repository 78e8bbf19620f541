"""Composing the config tree outside ``@hydra.main`` and turning Hydra's errors into one line."""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from corelib.config import register_schemas
from corelib.errors import ConfigError
from corelib.plugins import PluginRegistry

CONFIG_MODULE = "corelib.conf"
CONFIG_NAME = "config"


def prepare_config_store(registry: PluginRegistry) -> None:
    """Register the schemas and the backend configs that plugins ship outside ``conf/``."""
    register_schemas()
    store = ConfigStore.instance()
    for name, path in registry.config_files.items():
        try:
            node = OmegaConf.load(path)
        except (OSError, OmegaConfBaseException) as error:
            raise ConfigError(f"backend config {path} of plugin backend {name!r} cannot be read: {error}") from None
        store.store(group="backend", name=name, node=node)


@contextmanager
def hydra_context() -> Iterator[None]:
    """Use the running Hydra app if there is one, else initialise corelib's config module."""
    if GlobalHydra.instance().is_initialized():
        yield
        return
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        yield


def compose_config(overrides: Sequence[str]) -> DictConfig:
    """Compose ``config.yaml`` with overrides; any mistake becomes a one-line ConfigError."""
    with hydra_context():
        try:
            return compose(config_name=CONFIG_NAME, overrides=list(overrides))
        except (HydraException, OmegaConfBaseException, ValueError) as error:
            raise translate_error(error) from None


def load_group_option(group: str, option: str) -> DictConfig:
    """The composed node of one option of a group, e.g. ``backend/cuda``."""
    cfg = compose_config([f"{group}={option}"])
    node = cfg[group]
    assert isinstance(node, DictConfig), f"{group}={option} did not compose to a mapping"
    return node


def translate_error(error: BaseException) -> ConfigError:
    """Make Hydra's and OmegaConf's multi-line messages one line that names the key."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, OmegaConfBaseException):
            return ConfigError(_omegaconf_message(cause))
        if isinstance(cause, MissingConfigException):
            return ConfigError(_missing_message(cause))
        cause = cause.__cause__ or cause.__context__
    return ConfigError(" ".join(str(error).split()))


def _omegaconf_message(error: OmegaConfBaseException) -> str:
    key = getattr(error, "full_key", None) or ""
    msg = str(getattr(error, "msg", None) or error).splitlines()[0].strip()
    hint = ""
    missing = re.search(r"Key '([^']+)' (?:is )?not in", msg)
    if missing:
        siblings = _sibling_keys(error)
        prefixed = [k for k in siblings if k.startswith(missing.group(1))]
        close = prefixed[:1] or difflib.get_close_matches(missing.group(1), siblings, n=1)
        if close:
            hint = f" (did you mean {close[0]!r}?)"
    if key:
        return f"{key}: {msg}{hint}"
    return f"{msg}{hint}"


def _sibling_keys(error: OmegaConfBaseException) -> list[str]:
    object_type = getattr(error, "object_type", None)
    if isinstance(object_type, type) and dataclasses.is_dataclass(object_type):
        return [f.name for f in dataclasses.fields(object_type)]
    parent = getattr(error, "parent_node", None)
    if parent is not None and OmegaConf.is_dict(parent):
        return [str(k) for k in parent.keys()]
    return []


def _missing_message(error: MissingConfigException) -> str:
    text = str(error)
    wanted = re.search(r"Could not find '([^']+)'", text)
    options = re.findall(r"^\t(\S+)$", text, flags=re.MULTILINE)
    if wanted and "/" in wanted.group(1):
        group, _, option = wanted.group(1).rpartition("/")
        close = difflib.get_close_matches(option, options, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"{group}={option}: no such option; available: {', '.join(options) or 'none'}{hint}"
    return " ".join(text.split())
