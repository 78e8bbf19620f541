"""What a config may ask of Hydra, checked on every config Hydra composes before Hydra acts on it.

A config file can come from a shared directory (``hydra.searchpath``, a gate directory), and
Hydra acts on the ``hydra`` node of the composed config before corelib's task runs: it
configures logging from ``hydra.hydra_logging`` right after composing, builds
``hydra.callbacks`` (and, in a multirun, ``hydra.launcher``/``hydra.sweeper``) from their
``_target_``, configures ``hydra.job_logging``, sets ``hydra.job.env_set`` in the
environment, and writes into ``hydra.run.dir``. Each of these can run code or write files,
so corelib allows only:

- ``hydra.callbacks``: none;
- ``hydra.job.env_set``: nothing that changes the environment (set variables in the shell);
- ``hydra.launcher`` and ``hydra.sweeper``: Hydra's basic ones; a sweep may vary task keys,
  never ``hydra.*``; no other ``_target_`` anywhere under ``hydra``;
- ``hydra.hydra_logging`` and ``hydra.job_logging``: Hydra's forms (``default``, ``stdout``,
  ``disabled``, ``none``) or any change of levels and formats that only uses
  ``logging.StreamHandler`` to stdout or stderr, ``logging.NullHandler`` and
  ``logging.FileHandler`` on a file directly inside the run directory; no factories
  (``()``), no ``ext://`` objects, no filters but by logger name;
- where files go (``hydra.run.dir``, ``hydra.sweep.dir``, ``hydra.sweep.subdir``,
  ``hydra.output_subdir``): corelib's own values unless the command line sets them, and
  ``hydra.job.name`` a plain name;
- ``hydra.overrides``: only what the command line gave.

The check wraps Hydra's config loader for the duration of a command (:func:`guarded_composition`):
every composition Hydra makes, the first one and one per job of a multirun, is checked as it
is returned, before logging, callbacks, the launcher or the job see it.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from corelib.errors import ConfigError

BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
TARGET_KEY = "_target_"

LOGGING_KEYS = frozenset({"version", "formatters", "filters", "handlers", "loggers", "root",
                          "disable_existing_loggers", "incremental"})
SAFE_HANDLERS = frozenset({"logging.StreamHandler", "logging.NullHandler", "logging.FileHandler"})
HANDLER_KEYS = frozenset({"class", "level", "formatter", "filters", "stream", "filename", "mode", "encoding",
                          "delay", "errors"})
SAFE_STREAMS = frozenset({"ext://sys.stdout", "ext://sys.stderr"})
FORMATTER_KEYS = frozenset({"format", "datefmt", "style", "validate", "defaults", "class"})
LOGGER_KEYS = frozenset({"level", "handlers", "propagate", "filters"})
# A log file's name: the run directory, then one plain file name (the job's name may be in it).
_RUN_DIR_FILE = re.compile(
    r"\$\{hydra[.:]runtime\.output_dir\}/(?:[\w.-]|\$\{hydra[.:]job\.name\})+"
)
LOCATION_KEYS = ("run.dir", "sweep.dir", "sweep.subdir", "output_subdir")
HYDRA_OUTPUT_SUBDIR = ".hydra"  # Hydra's own default, which corelib's config keeps


@contextmanager
def guarded_composition() -> Iterator[None]:
    """Check every config Hydra composes while the block runs; a refusal is a one-line ConfigError.

    Hydra offers no hook between composing and acting on the ``hydra`` node, so corelib
    wraps the one method every composition goes through (``hydra-core`` is pinned to 1.3,
    and the tests with hostile configs fail if the method moves).
    """
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    original = ConfigLoaderImpl.load_configuration

    @functools.wraps(original)
    def load_configuration(self: ConfigLoaderImpl, *args: Any, **kwargs: Any) -> DictConfig:
        cfg = original(self, *args, **kwargs)
        overrides = kwargs["overrides"] if "overrides" in kwargs else args[1]
        check_hydra_node(cfg, list(overrides))
        return cfg

    ConfigLoaderImpl.load_configuration = load_configuration  # type: ignore[method-assign]
    try:
        yield
    finally:
        ConfigLoaderImpl.load_configuration = original  # type: ignore[method-assign]


def check_hydra_node(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Refuse a ``hydra`` node that would run code, set the environment or write outside the run directory."""
    if "hydra" not in cfg:
        return
    try:
        raw = OmegaConf.to_container(cfg.hydra, resolve=False)
    except OmegaConfBaseException as error:
        raise ConfigError(f"hydra: cannot be read: {error}") from None
    if not isinstance(raw, dict):
        raise ConfigError("hydra: must be a mapping")
    hydra: dict[str, Any] = {str(key): value for key, value in raw.items()}
    _check_overrides(hydra, overrides)
    _check_callbacks(hydra)
    _check_environment(cfg, hydra)
    _check_launch(hydra)
    for key in ("hydra_logging", "job_logging"):
        _check_logging(f"hydra.{key}", hydra.get(key))
    _check_locations(cfg, hydra, overrides)


def _refuse(key: str, why: str) -> ConfigError:
    return ConfigError(f"{key}: refused: {why}")


def _check_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> None:
    # Hydra appends the command line's overrides to these lists; anything more came from a file,
    # and a multirun would apply it to every job.
    recorded = raw.get("overrides") or {}
    count = sum(len(recorded.get(part) or []) for part in ("hydra", "task"))
    if count != len(overrides):
        raise _refuse("hydra.overrides", "overrides come from the command line only, and a config file set some")


def _check_callbacks(raw: Mapping[str, Any]) -> None:
    callbacks = raw.get("callbacks") or {}
    for name in callbacks:
        raise _refuse(f"hydra.callbacks.{name}", "Hydra callbacks run code when Hydra starts; corelib takes none")


def _check_environment(cfg: DictConfig, raw: Mapping[str, Any]) -> None:
    env_set = (raw.get("job") or {}).get("env_set") or {}
    for name in env_set:
        key = f"hydra.job.env_set.{name}"
        try:
            value = OmegaConf.select(cfg, key, throw_on_missing=True)
        except OmegaConfBaseException:
            value = None
        # hydra.job.env_copy fills env_set with the current values: those change nothing.
        if value is None or str(value) != os.environ.get(str(name)):
            raise _refuse(key, f"a config may not set environment variables (they reach every process corelib "
                               f"starts); set {name} in the shell that runs corelib")


def _check_launch(raw: Mapping[str, Any]) -> None:
    basic = {"launcher": BASIC_LAUNCHER, "sweeper": BASIC_SWEEPER}
    for part, target in basic.items():
        node = raw.get(part) or {}
        if node.get(TARGET_KEY) != target:
            raise _refuse(f"hydra.{part}._target_", f"{node.get(TARGET_KEY)!r}: only Hydra's basic {part} "
                                                    f"({target}) runs corelib jobs")
    params = (raw.get("sweeper") or {}).get("params") or {}
    for name in params:
        if str(name).lstrip("+~").split(".")[0].split("/")[0] == "hydra":
            raise _refuse(f"hydra.sweeper.params.{name}", "a sweep may vary the task's keys, not Hydra's")
    for path, value in _targets(raw, "hydra"):
        if path not in ("hydra.launcher._target_", "hydra.sweeper._target_"):
            raise _refuse(path, f"{TARGET_KEY} {str(value)[:80]!r}: nothing under hydra may be built from a config "
                                "but Hydra's basic launcher and sweeper")


def _targets(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}.{key}"
            if key == TARGET_KEY:
                yield where, value
            else:
                yield from _targets(value, where)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _targets(value, f"{path}[{index}]")


def _check_logging(key: str, conf: Any) -> None:
    if conf is None:
        return
    if not isinstance(conf, dict):
        raise _refuse(key, "a logging configuration must be a mapping")
    if conf.get("root", {}) is None:
        return  # Hydra configures nothing from a config whose root is null (hydra/job_logging=none)
    for name in conf:
        if name not in LOGGING_KEYS:
            raise _refuse(f"{key}.{name}", f"not a key of a logging configuration ({', '.join(sorted(LOGGING_KEYS))})")
    _check_no_factories(key, conf)
    for name, handler in (conf.get("handlers") or {}).items():
        _check_handler(f"{key}.handlers.{name}", handler)
    for name, formatter in (conf.get("formatters") or {}).items():
        _check_keys(f"{key}.formatters.{name}", formatter, FORMATTER_KEYS)
        if formatter.get("class", "logging.Formatter") != "logging.Formatter":
            raise _refuse(f"{key}.formatters.{name}.class", "only logging.Formatter formats corelib's log lines")
    for name, log_filter in (conf.get("filters") or {}).items():
        _check_keys(f"{key}.filters.{name}", log_filter, frozenset({"name"}))
    for name, logger in (conf.get("loggers") or {}).items():
        _check_keys(f"{key}.loggers.{name}", logger, LOGGER_KEYS)
    if conf.get("root") is not None:
        _check_keys(f"{key}.root", conf["root"], LOGGER_KEYS - {"propagate"})


def _check_no_factories(key: str, node: Any) -> None:
    """No ``()`` factory or ``.`` property anywhere, no ``ext://`` object but a standard stream."""
    if isinstance(node, dict):
        for name, value in node.items():
            where = f"{key}.{name}"
            if name in ("()", "."):
                raise _refuse(where, "logging factories and properties run code; use a plain handler and formatter")
            if name == "stream" and value in SAFE_STREAMS:
                continue
            _check_no_factories(where, value)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            _check_no_factories(f"{key}[{index}]", value)
    elif isinstance(node, str) and node.startswith("ext://"):
        raise _refuse(key, f"{node!r}: a logging configuration may name no Python object but sys.stdout or sys.stderr")


def _check_keys(key: str, node: Any, allowed: frozenset[str]) -> None:
    if not isinstance(node, dict):
        raise _refuse(key, "expected a mapping")
    for name in node:
        if name not in allowed:
            raise _refuse(f"{key}.{name}", f"not allowed here; allowed: {', '.join(sorted(allowed))}")


def _check_handler(key: str, handler: Any) -> None:
    _check_keys(key, handler, HANDLER_KEYS)
    kind = handler.get("class")
    if kind not in SAFE_HANDLERS:
        raise _refuse(f"{key}.class", f"{kind!r}: a log handler may only be one of {', '.join(sorted(SAFE_HANDLERS))}")
    if "stream" in handler and handler["stream"] not in SAFE_STREAMS:
        raise _refuse(f"{key}.stream", f"{handler['stream']!r}: a stream handler writes to ext://sys.stdout or "
                                       "ext://sys.stderr")
    if kind == "logging.FileHandler":
        filename = handler.get("filename")
        if not isinstance(filename, str) or not _RUN_DIR_FILE.fullmatch(filename) or ".." in filename:
            raise _refuse(f"{key}.filename", f"{filename!r}: a log file must be directly inside the run directory "
                                             "(${hydra.runtime.output_dir}/NAME.log)")


@functools.lru_cache(maxsize=1)
def _corelib_locations() -> dict[str, Any]:
    """``hydra.run.dir`` and the others as corelib's ``config.yaml`` sets them (unresolved)."""
    text = (importlib.resources.files("corelib.conf") / "config.yaml").read_text()
    hydra = OmegaConf.to_container(OmegaConf.create(text), resolve=False).get("hydra") or {}  # type: ignore[union-attr]
    locations = {key: _lookup(hydra, key) for key in LOCATION_KEYS}
    if locations["output_subdir"] is None:
        locations["output_subdir"] = HYDRA_OUTPUT_SUBDIR
    return locations


def _lookup(node: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _overridden(overrides: Sequence[str]) -> set[str]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return {override.key_or_group for override in OverridesParser.create().parse_overrides(list(overrides))}


def _check_locations(cfg: DictConfig, raw: Mapping[str, Any], overrides: Sequence[str]) -> None:
    given = _overridden(overrides)
    for key, default in _corelib_locations().items():
        value = _lookup(raw, key)
        allowed = {default, None} if key == "output_subdir" else {default}
        if f"hydra.{key}" not in given and value not in allowed:
            raise _refuse(f"hydra.{key}", f"{str(value)[:80]!r}: where corelib writes is chosen by corelib's config "
                                          f"or the command line (hydra.{key}=...), not by a config file")
    try:
        name = str(OmegaConf.select(cfg, "hydra.job.name", throw_on_missing=True))
    except OmegaConfBaseException:
        return
    if not name or name in (".", "..") or "/" in name or os.sep in name:
        raise _refuse("hydra.job.name", f"{name!r}: must be a plain name (it becomes part of file names)")
