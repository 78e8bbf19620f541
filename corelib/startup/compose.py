"""Composing the config tree, checking it, and turning Hydra's errors into one line."""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from hydra.utils import get_object
from omegaconf import Container, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from corelib.config.gate_catalog import is_registered, register_gates
from corelib.config.schema import register_schemas
from corelib.errors import ConfigError, UnknownOption, one_line
from corelib.trust.task_config import check_task_values

CONFIG_MODULE = "corelib.conf"
CONFIG_NAME = "config"
TARGET_KEY = "_target_"


_plugin_configs: dict[str, bool] = {"ready": False}
_plugin_gates: dict[str, Path] = {}  # the feature gates of the last prepare_config_store


class PluginConfigs(Protocol):
    """Where the plugins' backend options and feature gates are: a loaded PluginRegistry, or a
    PluginCatalog that knows without torch."""

    @property
    def config_files(self) -> Mapping[str, Path]: ...

    @property
    def feature_files(self) -> Mapping[str, Path]: ...


def prepare_config_store(plugins: PluginConfigs) -> None:
    """Register the schemas, every feature gate, and the backend configs the plugins ship (built-in ones too)."""
    _plugin_configs["ready"] = True
    _plugin_gates.clear()
    _plugin_gates.update(plugins.feature_files)
    register_gates(_plugin_gates)  # before the schemas: a gate may declare an engine key
    register_schemas()
    store = ConfigStore.instance()
    for name, path in plugins.config_files.items():
        try:
            node = OmegaConf.load(path)
        except (OSError, OmegaConfBaseException) as error:
            raise ConfigError(f"backend config {path} cannot be read: {one_line(error)}") from None
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
    """Compose ``config.yaml`` with overrides; any mistake becomes a one-line ConfigError.

    The backend options come from the plugins: unless ``prepare_config_store`` ran with a
    registry of the caller's, the installed plugins are loaded once to find them.
    """
    if not _plugin_configs["ready"]:
        from corelib.plugins import PluginRegistry

        prepare_config_store(PluginRegistry())
    elif not is_registered():
        register_gates(_plugin_gates)
    register_schemas()
    with hydra_context():
        try:
            cfg = compose(config_name=CONFIG_NAME, overrides=list(overrides))
        except (HydraException, OmegaConfBaseException, ValueError) as error:
            raise translate_error(error) from None
    check_schema_keys(cfg)
    check_task_values(cfg, overrides)
    return cfg


def load_group_option(group: str, option: str) -> DictConfig:
    """The composed node of one option of a group, e.g. ``backend/cuda``."""
    cfg = compose_config([f"{group}={option}"])
    node = cfg[group]
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{group}={option} does not compose to a mapping; fix {group}/{option}.yaml")
    return node


def check_schema_keys(cfg: DictConfig) -> None:
    """Refuse keys that no schema declares.

    Hydra's ``+key=value`` adds a key even where the schema has none, and the typed config
    would then drop it without a word; a misspelled ``+engine.grahp=on`` must fail instead.
    """
    for path, node in _walk(cfg):
        if not isinstance(node, DictConfig):
            continue
        schema = OmegaConf.get_type(node)
        if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
            continue
        fields = [f.name for f in dataclasses.fields(schema)]
        for raw_key in node:
            key = str(raw_key)
            if key in fields:
                continue
            where = f"{path}.{key}" if path else key
            if key == TARGET_KEY:
                target = str(node._get_node(key))[:80]
                raise ConfigError(f"{where}: {TARGET_KEY} '{target}' is refused: nothing is built there")
            raise ConfigError(f"{where}: not a config key{_did_you_mean(key, fields, path)}")


def check_targets(cfg: DictConfig, allowed: Iterable[str] = ("corelib",)) -> None:
    """Refuse any ``_target_`` outside corelib and the loaded plugins' packages.

    A config file from elsewhere must not be able to run arbitrary code through Hydra's
    ``instantiate``. The target is located (importing only trusted packages, since the path
    is checked first) and must be defined in a trusted package, so a name re-exported from
    the standard library (``corelib.cli.main.os.system``) is refused too.
    """
    prefixes = sorted(set(allowed))
    trusted = ", ".join(prefixes)
    try:
        plain = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as error:
        raise translate_error(error) from None
    for path, target in _find_targets(plain, ""):
        if not isinstance(target, str) or not _within(target, prefixes):
            raise ConfigError(
                f"{path}: {TARGET_KEY} {target!r} is refused: configs may only build objects from {trusted}"
            )
        try:
            obj = get_object(target)
        except Exception as error:  # noqa: BLE001 - any lookup failure is the config's mistake
            raise ConfigError(f"{path}: {TARGET_KEY} {target!r} cannot be found: {one_line(error)}") from None
        module = getattr(obj, "__module__", None)
        if not isinstance(module, str) or not _within(module, prefixes):
            origin = module if isinstance(module, str) else "an unknown module"
            raise ConfigError(
                f"{path}: {TARGET_KEY} {target!r} is refused: it is defined in {origin}, "
                f"and configs may only build objects from {trusted}"
            )


def _within(dotted: str, prefixes: Sequence[str]) -> bool:
    return any(dotted == prefix or dotted.startswith(prefix + ".") for prefix in prefixes)


def _find_targets(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            if key == TARGET_KEY:
                yield where, value
            else:
                yield from _find_targets(value, where)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _find_targets(value, f"{path}[{index}]")


def _walk(node: Container, path: str = "") -> Iterator[tuple[str, Container]]:
    yield path, node
    if isinstance(node, DictConfig):
        children: Iterable[tuple[str, Any]] = (
            (f"{path}.{key!s}" if path else str(key), node._get_node(key)) for key in node
        )
    elif isinstance(node, ListConfig):
        children = ((f"{path}[{index}]", node._get_node(index)) for index in range(len(node)))
    else:
        return
    for child_path, child in children:
        if isinstance(child, Container):
            yield from _walk(child, child_path)


def translate_error(error: BaseException) -> ConfigError:
    """Make Hydra's and OmegaConf's multi-line messages one line that names the key."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, OverrideParseException):
            detail = " ".join(cause.message.split())
            return ConfigError(f"cannot parse the override {cause.override!r}: {detail}")
        if isinstance(cause, OmegaConfBaseException):
            return ConfigError(_omegaconf_message(cause))
        if isinstance(cause, MissingConfigException):
            return _missing_option(cause)
        cause = cause.__cause__ or cause.__context__
    return ConfigError(" ".join(str(error).split()))


def _did_you_mean(key: str, candidates: Sequence[str], parent: str) -> str:
    prefixed = [k for k in candidates if k.startswith(key)]
    close = prefixed[:1] or difflib.get_close_matches(key, candidates, n=1)
    if close:
        return f" (did you mean {close[0]!r}?)"
    if candidates:
        return f"; the keys of {parent or 'the config'} are: {', '.join(candidates)}"
    return ""


def _omegaconf_message(error: OmegaConfBaseException) -> str:
    key = getattr(error, "full_key", None) or ""
    msg = str(getattr(error, "msg", None) or error).splitlines()[0].strip()
    hint = ""
    missing = re.search(r"Key '([^']+)' (?:is )?not in", msg)
    siblings = _sibling_keys(error)
    if missing and siblings:
        hint = _did_you_mean(missing.group(1), siblings, key.rpartition(".")[0])
    elif missing and key:
        hint = f" (a key the config does not have yet is added with +{key}=VALUE)"
    if key:
        return f"{key}: {msg}{hint}"
    return f"{msg}{hint}"


def _sibling_keys(error: OmegaConfBaseException) -> list[str]:
    object_type = getattr(error, "object_type", None)
    if isinstance(object_type, type) and dataclasses.is_dataclass(object_type):
        return [f.name for f in dataclasses.fields(object_type)]
    parent = getattr(error, "parent_node", None)
    if parent is not None and OmegaConf.is_dict(parent):
        return [str(k) for k in parent]
    return []


def _missing_option(error: MissingConfigException) -> ConfigError:
    text = str(error)
    wanted = re.search(r"Could not find '([^']+)'", text)
    options = re.findall(r"^\t(\S+)$", text, flags=re.MULTILINE)
    if wanted and "/" in wanted.group(1):
        group, _, option = wanted.group(1).rpartition("/")
        close = difflib.get_close_matches(option, options, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        message = f"{group}={option}: no such option; available: {', '.join(options) or 'none'}{hint}"
        return UnknownOption(message, group, option)
    return ConfigError(" ".join(text.split()))
