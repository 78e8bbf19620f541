"""``python -m corelib {run,plan,backends,bench,serve,bench-serve} [hydra overrides]``, and ``trace-plot``.

Exit codes: 0 success, 2 bad configuration or a refused plan, 1 runtime failure, 130 on
Ctrl-C, 143 on SIGTERM (the same clean shutdown as Ctrl-C). An error prints one line
(``HYDRA_FULL_ERROR=1`` adds the traceback; the exit code stays the same).
"""

from __future__ import annotations

import difflib
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from corelib.errors import ConfigError, CorelibError, UnknownOption, one_line

if TYPE_CHECKING:
    from corelib.plugins import PluginRegistry

USAGE = """usage: python -m corelib COMMAND [group=option ...] [key=value ...] [--help] [--cfg job] [-m]

commands:
  run       run the workload through the engine and write outputs into the run directory
  plan      show which features are enabled and why, without running
  backends  list installed backend plugins and whether they run natively, emulated, or not at all
  bench     sweep batch size, handoff, transport and backend; print a table, write bench.json
  trace-plot  render decode steps of trace.json files (engine.trace=true) into a PNG (trace-plot --help)
  serve     an OpenAI-compatible HTTP server over the engine (server.port=8000; needs corelib[serve])
  bench-serve  load a running server (server.bench.*): throughput, TTFT, TPOT, lost responses

Every command but backends takes Hydra overrides: pick an option per group (backend=npu,
model=small-0.6b) and set any key (engine.async_token_handoff=on). COMMAND --help lists them.

examples:
  python -m corelib run backend=npu engine.async_token_handoff=on workload.num_requests=64
  python -m corelib plan backend=cuda backend.runtime=emulated
  python -m corelib plan -m backend=cpu,npu
  python -m corelib run --help

exit codes: 0 success, 2 bad configuration or refused plan, 1 runtime failure, 130 interrupted,
143 terminated (SIGTERM).
HYDRA_FULL_ERROR=1 shows the traceback behind an error."""

BACKENDS_USAGE = """usage: python -m corelib backends

List every backend plugin of the entry-point group corelib.backends: the backends it
provides, whether each runs natively here, on the stream emulator, or not at all, and why.
CORELIB_PLUGINS=a,b loads only those plugins; CORELIB_BLOCK_PLUGINS=a,b skips those."""

# Hydra's own flags and whether each takes a value; ``--info`` takes one of a few words.
_FLAGS_WITH_VALUE = frozenset(
    {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
     "--config-dir", "-cd", "--experimental-rerun"}
)
_INFO_FLAGS = frozenset({"--info", "-i"})
_PLAIN_FLAGS = frozenset(
    {"-h", "--help", "--hydra-help", "--version", "--resolve", "-m", "--multirun", "--run",
     "-sc", "--shell-completion"}
)
_INFO_VALUES = frozenset({"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"})
_COMMANDS = ("run", "plan", "backends", "bench", "trace-plot", "serve", "bench-serve")
_job_log = logging.getLogger("corelib.console")  # Hydra's job logging writes it to the run directory's log
# Flags that leave the config tree as it is, so composing without them gives the same result.
_PRECHECK_FLAGS = frozenset({"--cfg", "-c", "--resolve", "--package", "-p", "-m", "--multirun"})


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived. A KeyboardInterrupt, so that it unwinds exactly like Ctrl-C: every
    ``with`` and ``finally`` on the way out closes engines, stops workers and removes segments."""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(USAGE, file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    try:
        with _sigterm_unwinds():
            if command not in _COMMANDS:
                close = difflib.get_close_matches(command, _COMMANDS, n=1)
                hint = f"did you mean {close[0]!r}?" if close else "see python -m corelib --help"
                raise ConfigError(f"unknown command {command!r}; expected one of {', '.join(_COMMANDS)} ({hint})")
            if command == "backends":
                return _backends_command(rest)
            if command == "trace-plot":
                return _trace_plot_command(rest)
            return _hydra_command(command, rest)
    except CorelibError as error:
        return _report(error)
    except Terminated:
        print("corelib: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("corelib: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (``| head``); say nothing more, and keep Python's exit-time
        # flush of stdout from raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as error:  # noqa: BLE001 - reported in one line, with its traceback on request
        # Not a user's mistake but a failure inside (a device, a plugin, a bug): still one
        # line naming it, and the exit code of a runtime failure.
        if _full_error():
            traceback.print_exception(error, file=sys.stderr)
            print(f"corelib: error: {one_line(error)}", file=sys.stderr)
            return 1
        print(f"corelib: error: {one_line(error)} (HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
        return 1


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """Turn the first SIGTERM into :class:`Terminated` in the main thread; later ones wait for the cleanup."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers (an embedding application's worker thread)
        return
    fired = False

    def terminate(signum: int, frame: FrameType | None) -> None:
        nonlocal fired
        if not fired:
            fired = True
            raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _report(error: CorelibError) -> int:
    if _full_error():
        # The traceback, then the same line and exit code as without the variable.
        traceback.print_exception(error, file=sys.stderr)
    for cause in _causes(error):
        for line in str(cause).splitlines() or [type(cause).__name__]:
            print(f"corelib: error: {line}", file=sys.stderr)
    return error.exit_code


def _causes(error: CorelibError) -> list[CorelibError]:
    """``error`` and the corelib errors it was raised while handling, the first cause first.

    A run that fails and then cannot close cleanly (a stalled stream) raises the close error
    from the ``with`` block; the step error that started it is what the user needs first.
    """
    chain = [error]
    while True:
        latest = chain[-1]
        context = latest.__context__
        if latest.__suppress_context__ or not isinstance(context, CorelibError) or context in chain:
            return chain[::-1]
        chain.append(context)


def _full_error() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def _import_torch() -> None:
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


def _registry(overrides: Sequence[str] = ()) -> PluginRegistry:
    _import_torch()
    from corelib.compose import prepare_config_store
    from corelib.plugins import PluginRegistry

    allow, block = _plugin_restrictions(overrides)
    registry = PluginRegistry(allow=allow, block=block)
    prepare_config_store(registry)
    return registry


def _plugin_restrictions(overrides: Sequence[str]) -> tuple[list[str] | None, list[str]]:
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
    return overrides, flags


def _hydra_command(command: str, rest: list[str]) -> int:
    from corelib.trust import guarded_composition

    overrides, flags = split_arguments(rest)
    # Every config Hydra composes from here on is checked before Hydra acts on its hydra node.
    with guarded_composition():
        return _guarded_hydra_command(command, overrides, flags)


def _guarded_hydra_command(command: str, overrides: list[str], flags: list[str]) -> int:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from corelib.compose import translate_error

    _import_torch()  # composing loads the plugin registry, which imports torch
    if all(flag in _PRECHECK_FLAGS or not flag.startswith("-") for flag in flags):
        _precheck(overrides)
    registry = _registry(overrides)
    if {"-h", "--help"} & set(flags):
        from corelib.config_help import render_help

        print(render_help(command, overrides))
        return 0
    task_fn = _tasks()[command]
    failures: list[tuple[str, CorelibError]] = []

    def task(cfg: DictConfig) -> None:
        hydra_cfg = HydraConfig.get()
        try:
            task_fn(cfg, registry, Path(hydra_cfg.runtime.output_dir))
        except CorelibError as error:
            # Kept, not raised: Hydra would print its own line about the failed job first.
            failures.append((" ".join(hydra_cfg.overrides.task), error))
            _job_log.info("error: %s", error)  # the job's run.log says why it stopped; stderr gets it from _report
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
            raise _explain(translate_error(error), registry) from error
    if len(failures) == 1 and not ({"-m", "--multirun"} & set(flags)):
        raise failures[0][1]
    if failures:
        raise JobsFailed(failures)
    return 0


def _explain(error: ConfigError, registry: PluginRegistry) -> CorelibError:
    """An unknown ``backend=`` option is often a plugin that did not load: say that instead."""
    if isinstance(error, UnknownOption) and error.group == "backend" and error.option in registry.records:
        try:
            registry.get(error.option)
        except CorelibError as reason:
            return reason
    return error


class JobsFailed(CorelibError):
    """Some jobs of a multirun failed; one line per failure, prefixed with the job's overrides."""

    def __init__(self, failures: list[tuple[str, CorelibError]]) -> None:
        self.failures = failures
        self.exit_code = max(error.exit_code for _, error in failures)
        lines = [f"job [{job}]: {line}" for job, error in failures for line in str(error).splitlines()]
        super().__init__("\n".join(lines))


def _precheck(overrides: list[str]) -> None:
    """Compose before loading any plugin, so a bad override fails in a fraction of a second.

    Loading the plugins imports torch and every backend; only an unknown ``backend=`` option
    needs them (a plugin may ship it), so that one error is left for the full compose.
    Sweeps (``a=1,2``) are left to Hydra's multirun.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from corelib.compose import compose_config, translate_error

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
    from corelib.commands import bench_serve_task, bench_task, plan_task, run_task, serve_task

    return {"run": run_task, "plan": plan_task, "bench": bench_task, "serve": serve_task,
            "bench-serve": bench_serve_task}


def _trace_plot_command(rest: list[str]) -> int:
    from corelib.trace_plot import main as trace_plot

    return trace_plot(rest)


def _backends_command(rest: list[str]) -> int:
    if rest in (["-h"], ["--help"]):
        print(BACKENDS_USAGE)
        return 0
    if rest:
        raise ConfigError(
            f"backends takes no arguments (got {' '.join(rest)}); "
            "restrict plugins with CORELIB_PLUGINS or CORELIB_BLOCK_PLUGINS"
        )
    from corelib.commands import print_backends

    print_backends(_registry())
    return 0
