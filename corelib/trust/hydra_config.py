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
- ``hydra.hydra_logging`` and ``hydra.job_logging``: see :mod:`corelib.trust.logging_config` (plain
  handlers to stdout, stderr, or a ``.log`` file directly inside the run directory, checked
  again once resolved);
- ``hydra.runtime``: nothing (Hydra fills it; its ``output_dir`` is what a log file is named by);
- where files go (``hydra.run.dir``, ``hydra.sweep.dir``, ``hydra.sweep.subdir``,
  ``hydra.output_subdir``): corelib's own values unless the command line sets them,
  ``hydra.output_subdir`` inside the run directory even then, and ``hydra.job.name`` a plain name;
- ``hydra.overrides``: only what the command line gave.

The check wraps Hydra's config loader for the duration of a command (:func:`guarded_composition`):
every composition Hydra makes, the first one and one per job of a multirun, is checked as it
is returned, before logging, callbacks, the launcher or the job see it; the task config's
operator settings and environment reads are checked then too (:mod:`corelib.trust.task_config`).
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import posixpath
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from corelib.errors import ConfigError
from corelib.trust.files import check_directory_for_writing
from corelib.trust.logging_config import check_logging, checked_configure_log
from corelib.trust.task_config import check_task_values

BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
TARGET_KEY = "_target_"

LOCATION_KEYS = ("run.dir", "sweep.dir", "sweep.subdir", "output_subdir")
RUNTIME_KEYS = frozenset({"version", "version_base", "cwd", "config_sources", "output_dir", "choices"})
MISSING_VALUE = "???"  # OmegaConf's mark for a value not set yet
HYDRA_OUTPUT_SUBDIR = ".hydra"  # Hydra's own default, which corelib's config keeps


@contextmanager
def guarded_composition() -> Iterator[None]:
    """Check every config Hydra composes while the block runs; a refusal is a one-line ConfigError.

    Hydra offers no hook between composing and acting on the ``hydra`` node, so corelib
    wraps the one method every composition goes through (``hydra-core`` is pinned to 1.3,
    and the tests with hostile configs fail if the method moves).
    """
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.types import RunMode

    original = ConfigLoaderImpl.load_configuration

    @functools.wraps(original)
    def load_configuration(self: ConfigLoaderImpl, *args: Any, **kwargs: Any) -> DictConfig:
        cfg = original(self, *args, **kwargs)
        overrides = kwargs["overrides"] if "overrides" in kwargs else args[1]
        config_name = kwargs["config_name"] if "config_name" in kwargs else args[0]
        check_hydra_node(cfg, list(overrides), primary=config_name is not None)
        check_task_values(cfg, list(overrides))
        if config_name is not None:
            run_mode = kwargs["run_mode"] if "run_mode" in kwargs else args[2]
            _check_output_directory(cfg, "hydra.sweep.dir" if run_mode == RunMode.MULTIRUN else "hydra.run.dir")
        return cfg

    ConfigLoaderImpl.load_configuration = load_configuration  # type: ignore[method-assign]
    try:
        with checked_configure_log():
            yield
    finally:
        ConfigLoaderImpl.load_configuration = original  # type: ignore[method-assign]


def check_hydra_node(cfg: DictConfig, overrides: Sequence[str], primary: bool = True) -> None:
    """Refuse a ``hydra`` node that would run code, set the environment or write outside the run directory.

    ``primary=False``: Hydra composed its own config alone (``--hydra-help``), whose locations are Hydra's.
    """
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
    _check_runtime(hydra, overrides)
    for key in ("hydra_logging", "job_logging"):
        check_logging(f"hydra.{key}", hydra.get(key))
    _check_locations(cfg, hydra, overrides, _corelib_locations() if primary else _hydra_locations())


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


def _check_output_directory(cfg: DictConfig, key: str) -> None:
    """Where the job (or the sweep) will write, resolved as Hydra will resolve it, before Hydra makes it."""
    try:
        where = OmegaConf.select(cfg, key, throw_on_missing=True)
    except OmegaConfBaseException:
        return  # Hydra reports what it cannot resolve in its own words
    if where is not None:
        check_directory_for_writing(str(where), key)


def _check_output_subdir(cfg: DictConfig, raw: Any) -> None:
    """``hydra.output_subdir``, from wherever it came, names a directory inside the run directory.

    Hydra writes ``config.yaml``, ``hydra.yaml`` and ``overrides.yaml`` into the run directory
    joined with it, so an absolute path, or one whose ``..`` climbs out, puts (or overwrites)
    those files anywhere: the command line is checked too, not only config files.
    """
    key = "hydra.output_subdir"
    try:
        value = OmegaConf.select(cfg, key, throw_on_missing=True)
    except OmegaConfBaseException:
        raise _refuse(key, f"{str(raw)[:80]!r} cannot be resolved before Hydra writes into it; give a relative "
                           "directory") from None
    if value is None:
        return  # Hydra writes no copy of the config
    subdir = str(value)
    normal = posixpath.normpath(subdir)
    if os.path.isabs(subdir) or normal == ".." or normal.startswith("../"):
        raise _refuse(key, f"{subdir[:80]!r} leaves the run directory; Hydra writes its copy of the config there, so "
                           "it must be a directory inside it (the default: .hydra)")


def _check_runtime(raw: Mapping[str, Any], overrides: Sequence[str]) -> None:
    # Hydra fills hydra.runtime itself: the loader sets its version, cwd and sources, and the job sets
    # output_dir only after Hydra's own logging started, so a value from a config would be used first.
    for override in _overridden(overrides):
        if override == "hydra.runtime" or override.startswith("hydra.runtime."):
            raise _refuse(override, "hydra.runtime is Hydra's record of the run; set hydra.run.dir instead")
    runtime = raw.get("runtime") or {}
    output_dir = runtime.get("output_dir", MISSING_VALUE)
    if output_dir != MISSING_VALUE:
        raise _refuse("hydra.runtime.output_dir", f"{str(output_dir)[:80]!r}: Hydra sets it from hydra.run.dir once "
                                                  "the job starts; a config file may not")
    for key in runtime:
        if key not in RUNTIME_KEYS:
            raise _refuse(f"hydra.runtime.{key}", "hydra.runtime is Hydra's record of the run; a config may not "
                                                  "add to it")


@functools.lru_cache(maxsize=1)
def _hydra_locations() -> dict[str, Any]:
    """The same keys as Hydra's own config sets them, for a composition without corelib's config."""
    text = (importlib.resources.files("hydra.conf") / "hydra" / "output" / "default.yaml").read_text()
    hydra = OmegaConf.to_container(OmegaConf.create(text), resolve=False)  # its package is hydra
    return {key: _lookup(hydra, key) if key != "output_subdir" else HYDRA_OUTPUT_SUBDIR for key in LOCATION_KEYS}


def _check_locations(cfg: DictConfig, raw: Mapping[str, Any], overrides: Sequence[str],
                     defaults: Mapping[str, Any]) -> None:
    given = _overridden(overrides)
    for key, default in defaults.items():
        value = _lookup(raw, key)
        allowed = {default, None} if key == "output_subdir" else {default}
        if f"hydra.{key}" not in given and value not in allowed:
            raise _refuse(f"hydra.{key}", f"{str(value)[:80]!r}: where corelib writes is chosen by corelib's config "
                                          f"or the command line (hydra.{key}=...), not by a config file")
    _check_output_subdir(cfg, _lookup(raw, "output_subdir"))
    try:
        name = str(OmegaConf.select(cfg, "hydra.job.name", throw_on_missing=True))
    except OmegaConfBaseException:
        return
    if not name or name in (".", "..") or "/" in name or os.sep in name:
        raise _refuse("hydra.job.name", f"{name!r}: must be a plain name (it becomes part of file names)")
