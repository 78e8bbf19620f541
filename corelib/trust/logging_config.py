"""What a config's logging may do: write to stdout, stderr, or a log file directly inside the run directory.

Hydra configures logging twice: ``hydra.hydra_logging`` right after composing (before it has
chosen the run directory, so ``${hydra.runtime.output_dir}`` means whatever the config says),
and ``hydra.job_logging`` once the job's directory is set. A file handler is a way to write
any file, so it is checked twice:

- as composed (:func:`check_logging`): only plain handlers and formatters, no factories, no
  ``ext://`` objects, and a file handler only in ``hydra.job_logging``, named
  ``${hydra.runtime.output_dir}/NAME.log``;
- as Hydra resolves it, the moment before it opens any file (:func:`checked_configure_log`):
  each file's resolved path must lie directly inside the resolved run directory and must not
  be a symlink; the files Hydra itself writes there (``.hydra/*.yaml``) must not be symlinks
  either, so a run directory someone else prepared cannot send the writes elsewhere.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from corelib.errors import ConfigError

LOGGING_KEYS = frozenset({"version", "formatters", "filters", "handlers", "loggers", "root",
                          "disable_existing_loggers", "incremental"})
SAFE_HANDLERS = frozenset({"logging.StreamHandler", "logging.NullHandler", "logging.FileHandler"})
HANDLER_KEYS = frozenset({"class", "level", "formatter", "filters", "stream", "filename", "mode", "encoding",
                          "delay", "errors"})
SAFE_STREAMS = frozenset({"ext://sys.stdout", "ext://sys.stderr"})
FORMATTER_KEYS = frozenset({"format", "datefmt", "style", "validate", "defaults", "class"})
LOGGER_KEYS = frozenset({"level", "handlers", "propagate", "filters"})
# A log file's name: the run directory, then one plain name ending in .log (the job's name may be in it).
_NAME_PART = r"(?:[\w-]|\$\{hydra[.:]job\.name\})"
_RUN_DIR_FILE = re.compile(
    rf"\$\{{hydra[.:]runtime\.output_dir\}}/{_NAME_PART}(?:{_NAME_PART}|\.)*\.log"
)
HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")  # what Hydra writes into the output subdirectory


def _refuse(key: str, why: str) -> ConfigError:
    return ConfigError(f"{key}: refused: {why}")


def check_logging(key: str, conf: Any) -> None:
    """``hydra.hydra_logging`` or ``hydra.job_logging`` as composed (unresolved)."""
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
        _check_handler(key, f"{key}.handlers.{name}", handler)
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


def _check_handler(section: str, key: str, handler: Any) -> None:
    _check_keys(key, handler, HANDLER_KEYS)
    kind = handler.get("class")
    if kind not in SAFE_HANDLERS:
        raise _refuse(f"{key}.class", f"{kind!r}: a log handler may only be one of {', '.join(sorted(SAFE_HANDLERS))}")
    if "stream" in handler and handler["stream"] not in SAFE_STREAMS:
        raise _refuse(f"{key}.stream", f"{handler['stream']!r}: a stream handler writes to ext://sys.stdout or "
                                       "ext://sys.stderr")
    if kind != "logging.FileHandler":
        return
    if section == "hydra.hydra_logging":
        # Configured before Hydra sets the run directory: ${hydra.runtime.output_dir} is not known yet.
        raise _refuse(f"{key}.class", "Hydra's own logging starts before the run directory exists, so it may not "
                                      "write a file; log to a file from hydra.job_logging")
    filename = handler.get("filename")
    if not isinstance(filename, str) or not _RUN_DIR_FILE.fullmatch(filename) or ".." in filename:
        raise _refuse(f"{key}.filename", f"{filename!r}: a log file must be directly inside the run directory "
                                         "(${hydra.runtime.output_dir}/NAME.log)")


def check_resolved_files(log_config: DictConfig | None) -> None:
    """The files a logging configuration opens, resolved: each directly inside the run directory, none a symlink.

    Called as Hydra applies a logging configuration; for the job's, Hydra writes its own files
    into the run directory right after, so those are checked here too.
    """
    run_dir = _run_directory()
    for name, filename in _opened_files(log_config).items():
        key = f"the log handler {name!r}"
        if run_dir is None:
            raise _refuse(key, f"{filename!r}: a log file before the run directory is known")
        path = Path(os.path.abspath(filename))
        if os.path.realpath(path.parent) != os.path.realpath(run_dir):
            raise _refuse(key, f"{filename!r} resolves outside the run directory {run_dir}")
        _refuse_symlink(path, key)
    subdir = _output_subdir()
    if run_dir is not None and subdir is not None:
        parts = Path(subdir).parts  # a symlink at any level would take Hydra's files out of the run directory
        for depth in range(1, len(parts) + 1):
            _refuse_symlink(run_dir.joinpath(*parts[:depth]), "hydra.output_subdir")
        for name in HYDRA_FILES:
            _refuse_symlink(run_dir / subdir / name, "hydra.output_subdir")


def _opened_files(log_config: DictConfig | None) -> dict[str, str]:
    """Each file handler's file name, resolved as Hydra will resolve it."""
    if log_config is None:
        return {}
    conf = OmegaConf.to_container(log_config, resolve=False)
    if not isinstance(conf, dict) or conf.get("root") is None or not isinstance(conf.get("handlers"), dict):
        return {}  # Hydra configures nothing from a config whose root is null
    files: dict[str, str] = {}
    for name, handler in conf["handlers"].items():
        if not isinstance(handler, dict) or "filename" not in handler:
            continue
        try:
            files[str(name)] = str(OmegaConf.select(log_config, f"handlers.{name}.filename", throw_on_missing=True))
        except OmegaConfBaseException as error:
            raise _refuse(f"the log handler {name!r}", f"{handler['filename']!r} cannot be resolved yet ({error}); "
                                                       "a log file is named after the run directory") from None
    return files


def _refuse_symlink(path: Path, key: str) -> None:
    if path.is_symlink():
        raise _refuse(key, f"{path} is a symlink (to {os.readlink(path)!r}); corelib writes only files of its own "
                           "in the run directory: remove it, or choose a new directory with hydra.run.dir=...")


def _hydra_value(key: str) -> str | None:
    """A value of the running job's ``hydra`` node (None before Hydra holds one, or while it is unset)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    node: object = HydraConfig.get()
    value = OmegaConf.select(node, key, default=None) if isinstance(node, DictConfig) else None
    return None if value is None else str(value)


def _run_directory() -> Path | None:
    """The job's directory as Hydra set it (None before it has: while Hydra's own logging starts)."""
    output_dir = _hydra_value("runtime.output_dir")
    return Path(os.path.abspath(output_dir)) if output_dir else None


def _output_subdir() -> str | None:
    return _hydra_value("output_subdir")


@contextmanager
def checked_configure_log() -> Iterator[None]:
    """Check every logging configuration Hydra applies, resolved, the moment before it applies it."""
    from hydra._internal import hydra as hydra_internal
    from hydra._internal.core_plugins import basic_launcher
    from hydra.core import utils as hydra_utils

    original: Callable[..., None] = hydra_utils.configure_log

    @functools.wraps(original)
    def configure_log(log_config: DictConfig | None, *args: Any, **kwargs: Any) -> None:
        check_resolved_files(log_config)
        original(log_config, *args, **kwargs)

    modules = (hydra_utils, hydra_internal, basic_launcher)
    for module in modules:
        module.configure_log = configure_log  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in modules:
            module.configure_log = original  # type: ignore[attr-defined]
