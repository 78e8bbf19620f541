"""A command as a Hydra app: its arguments, the plugins' configs, a quick check, then the job.

Hydra's parser takes flags and overrides in its own order; :func:`split_arguments` accepts
any. Composing needs the backend options the plugins ship, so the plugins load first
(``plugins.allow`` and ``plugins.block`` are read from the overrides for that). Loading them
imports torch, except for ``serve``: its HTTP process asks a child for the plugins' configs
(:mod:`corelib.startup.plugin_catalog`) and leaves the startup to the engine process.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from corelib.errors import ConfigError, CorelibError, UnknownOption, one_line

if TYPE_CHECKING:
    from corelib.plugins import PluginRegistry

# Hydra's own flags and whether each takes a value; ``--info`` takes one of a few words.
_FLAGS_WITH_VALUE = frozenset(
    {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
     "--config-dir", "-cd"}
)
# Hydra's flags corelib does not take, and why.
_REFUSED_FLAGS = {
    "--experimental-rerun": "Hydra would unpickle the file (running any code in it) and skip every check of the "
                            "config; to run a job again, pass the overrides in its run directory's "
                            ".hydra/overrides.yaml",
}
_INFO_FLAGS = frozenset({"--info", "-i"})
_PLAIN_FLAGS = frozenset(
    {"-h", "--help", "--hydra-help", "--version", "--resolve", "-m", "--multirun", "--run",
     "-sc", "--shell-completion"}
)
_INFO_VALUES = frozenset({"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"})
HYDRA_FLAGS = _FLAGS_WITH_VALUE | _INFO_FLAGS | _PLAIN_FLAGS | frozenset(_REFUSED_FLAGS)  # refused by split_arguments


def takes_value(flag: str, following: str) -> bool:
    """Whether ``following`` is the value of Hydra's ``flag`` (``--cfg job``, ``--info config``)."""
    return flag in _FLAGS_WITH_VALUE or flag in _REFUSED_FLAGS or (flag in _INFO_FLAGS and following in _INFO_VALUES)
# Flags that leave the config tree as it is, so composing without them gives the same result.
_PRECHECK_FLAGS = frozenset({"--cfg", "-c", "--resolve", "--package", "-p", "-m", "--multirun"})
_job_log = logging.getLogger("corelib.console")  # Hydra's job logging writes it to the run directory's log

Task = Callable[[DictConfig, Path], None]
Explain = Callable[[str], "CorelibError | None"]  # why backend=NAME cannot be selected, if a plugin says why


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived. A KeyboardInterrupt, so that it unwinds exactly like Ctrl-C: every
    ``with`` and ``finally`` on the way out closes engines, stops workers and removes segments."""


class JobsFailed(CorelibError):
    """Some jobs of a multirun failed; one line per failure, prefixed with the job's overrides."""

    def __init__(self, failures: list[tuple[str, CorelibError]]) -> None:
        self.failures = failures
        self.exit_code = max(error.exit_code for _, error in failures)
        lines = [f"job [{job}]: {line}" for job, error in failures for line in str(error).splitlines()]
        super().__init__("\n".join(lines))


def split_arguments(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separate Hydra's flags (with their values) from the overrides.

    Hydra's parser takes the overrides as one run of positional arguments, so an override
    after a flag (``plan --cfg job backend=npu x=1``) is fine but one between two flags is
    not; corelib accepts any order and hands Hydra overrides first, flags last.
    """
    overrides: list[str] = []
    flags: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        if not arg.startswith("-"):
            overrides.append(arg)
            continue
        name = arg.split("=", 1)[0]
        if name in _REFUSED_FLAGS:
            raise ConfigError(f"{name}: refused: {_REFUSED_FLAGS[name]}")
        if name not in _FLAGS_WITH_VALUE | _INFO_FLAGS | _PLAIN_FLAGS:
            raise ConfigError(f"unknown flag {name}; Hydra's flags are listed by --hydra-help")
        flags.append(arg)
        if "=" in arg:
            continue
        if arg in _FLAGS_WITH_VALUE:
            if index == len(args) or args[index].startswith("-"):
                raise ConfigError(f"{arg} needs a value (for --cfg: job, hydra or all)")
            flags.append(args[index])
            index += 1
        elif arg in _INFO_FLAGS and index < len(args) and args[index] in _INFO_VALUES:
            flags.append(args[index])
            index += 1
    _check_completion(overrides, flags)
    return overrides, flags


def _check_completion(overrides: Sequence[str], flags: Sequence[str]) -> None:
    """``-sc query=SHELL`` is what the shell's completion runs, with COMP_LINE set; by hand there is no line."""
    if not {"-sc", "--shell-completion"} & set(flags):
        return
    queries = [o for o in overrides if o.startswith("query=")]
    if queries and "COMP_LINE" not in os.environ:
        raise ConfigError(f"-sc {queries[0]}: the shell's completion runs this with COMP_LINE set; to set up "
                          f"completion run -sc install={queries[0].split('=', 1)[1] or 'bash'} and eval its output")


def plugin_restrictions(overrides: Sequence[str]) -> tuple[list[str] | None, list[str]]:
    """``plugins.allow``/``plugins.block`` from the command line, needed before composing.

    Plugins must load before the config is composed (they ship backend options), so these
    two keys are read from the overrides; startup checks the composed values again.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    allow: list[str] | None = None
    block: list[str] = []
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return allow, block  # composing reports the bad override in one line
    for override in parsed:
        if override.is_sweep_override() or override.is_delete():
            continue
        value = override.value()
        names = [str(v) for v in value] if isinstance(value, list) else None
        if override.key_or_group == "plugins.allow":
            allow = names
        elif override.key_or_group == "plugins.block":
            block = names or []
    return allow, block


def import_torch() -> None:
    """Import torch up front so a broken install is one line, not a traceback from a plugin."""
    try:
        import torch  # noqa: F401
    except Exception as error:
        cause = f" (caused by {one_line(error.__cause__)})" if error.__cause__ is not None else ""
        hint = ""
        if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") == "1":
            hint = (
                "; TORCH_DEVICE_BACKEND_AUTOLOAD=1 makes torch import every vendor extension: unset it, "
                "and each corelib plugin imports its own extension when probed"
            )
        raise CorelibError(f"torch cannot be imported: {one_line(error)}{cause}{hint}") from error


def plugin_registry(overrides: Sequence[str] = ()) -> PluginRegistry:
    """The plugins the overrides let load, their backend options registered for composing."""
    import_torch()
    from corelib.plugins import PluginRegistry
    from corelib.startup.compose import prepare_config_store

    allow, block = plugin_restrictions(overrides)
    registry = PluginRegistry(allow=allow, block=block)
    prepare_config_store(registry)
    return registry


def run_command(command: str, rest: list[str]) -> int:
    """``python -m corelib COMMAND ...`` for the commands that compose a config."""
    from corelib.trust.hydra_config import guarded_composition

    overrides, flags = split_arguments(rest)
    # Every config Hydra composes from here on is checked before Hydra acts on its hydra node.
    with guarded_composition():
        if command == "serve" and _serves_here(flags):
            return _serve(overrides, flags)
        registry = plugin_registry(overrides)
        if {"-h", "--help"} & set(flags):
            from corelib.cli.config_help import render_help

            print(render_help(command, overrides))
            return 0
        task = _tasks()[command]
        return _run_app(command, overrides, flags, lambda cfg, out: task(cfg, registry, out),
                        lambda name: _not_loaded(registry, name))


def _serves_here(flags: Sequence[str]) -> bool:
    """``serve`` on node 0 and not ``--help`` (which lists the keys of every group, the plugins' included)."""
    from corelib.transport.launch import launched_node

    return launched_node() == 0 and not {"-h", "--help"} & set(flags)


def _serve(overrides: list[str], flags: list[str]) -> int:
    """``serve`` without torch in this process: the plugins' configs from a child, the startup in the engine process."""
    from corelib.server.command import serve_task
    from corelib.startup.compose import prepare_config_store
    from corelib.startup.plugin_catalog import read_catalog

    catalog = read_catalog(*plugin_restrictions(overrides))
    prepare_config_store(catalog)
    return _run_app("serve", overrides, flags, serve_task, catalog.why_unavailable)


def _run_app(command: str, overrides: list[str], flags: list[str], task_fn: Task, explain: Explain) -> int:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from corelib.startup.compose import translate_error

    if all(flag in _PRECHECK_FLAGS or not flag.startswith("-") for flag in flags):
        _precheck(overrides)
    failures: list[tuple[str, CorelibError]] = []

    def task(cfg: DictConfig) -> None:
        hydra_cfg = HydraConfig.get()
        try:
            task_fn(cfg, Path(hydra_cfg.runtime.output_dir))
        except CorelibError as error:
            # Kept, not raised: Hydra would print its own line about the failed job first.
            failures.append((" ".join(hydra_cfg.overrides.task), error))
            _job_log.info("error: %s", error)  # the job's run.log says why it stopped; stderr gets it from main
        except KeyboardInterrupt as interrupt:
            _job_log.info("%s", "terminated (SIGTERM)" if isinstance(interrupt, Terminated) else "interrupted")
            raise
        except Exception as error:
            _job_log.info("error: %s", one_line(error))
            raise

    app = hydra.main(config_path="pkg://corelib.conf", config_name="config", version_base="1.3")(task)
    if not any(o.startswith("hydra.job.name=") for o in overrides):
        overrides.append(f"hydra.job.name={command}")
    with _hydra_raises(f"corelib {command}", [*overrides, *flags]):
        try:
            app()
        except (HydraException, OmegaConfBaseException) as error:
            raise _explained(translate_error(error), explain) from error
    if len(failures) == 1 and not ({"-m", "--multirun"} & set(flags)):
        raise failures[0][1]
    if failures:
        raise JobsFailed(failures)
    return 0


def _explained(error: ConfigError, explain: Explain) -> CorelibError:
    """An unknown ``backend=`` option is often a plugin that did not load: say that instead."""
    if isinstance(error, UnknownOption) and error.group == "backend":
        return explain(error.option) or error
    return error


def _not_loaded(registry: PluginRegistry, name: str) -> CorelibError | None:
    if name not in registry.records:
        return None
    try:
        registry.get(name)
    except CorelibError as reason:
        return reason
    return None


def _precheck(overrides: list[str]) -> None:
    """Compose once before the app, so a bad override fails in a fraction of a second.

    Only an unknown ``backend=`` option is left for the app (a plugin that did not load
    explains it there). Sweeps (``a=1,2``) are left to Hydra's multirun.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from corelib.startup.compose import compose_config, translate_error

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as error:
        raise translate_error(error) from error
    if any(o.is_sweep_override() for o in parsed):
        return
    try:
        compose_config(overrides)
    except UnknownOption as error:
        if error.group != "backend":
            raise


@contextmanager
def _hydra_raises(prog: str, argv: list[str]) -> Iterator[None]:
    """Run a Hydra app on ``argv`` with its exceptions raised to corelib, not printed by Hydra.

    Hydra prints a multi-line message and exits 1 unless HYDRA_FULL_ERROR=1; corelib wants
    the exception, to print one line and exit 2, so it sets the variable for the call.
    """
    saved_argv, saved_full = sys.argv, os.environ.get("HYDRA_FULL_ERROR")
    sys.argv = [prog, *argv]
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    finally:
        sys.argv = saved_argv
        if saved_full is None:
            del os.environ["HYDRA_FULL_ERROR"]
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved_full


def _tasks() -> dict[str, Callable[[DictConfig, PluginRegistry, Path], None]]:
    from corelib.cli.commands import bench_serve_task, bench_task, plan_task, run_task, serve_follower_task

    return {"run": run_task, "plan": plan_task, "bench": bench_task, "serve": serve_follower_task,
            "bench-serve": bench_serve_task}
