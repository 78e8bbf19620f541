"""``python -m corelib {run,plan,backends,bench,serve,bench-serve} [hydra overrides]``, and ``trace-plot``.

Exit codes: 0 success, 2 bad configuration or a refused plan, 1 runtime failure, 130 on
Ctrl-C, 143 on SIGTERM (the same clean shutdown as Ctrl-C). An error prints one line
(``HYDRA_FULL_ERROR=1`` adds the traceback; the exit code stays the same).
"""

from __future__ import annotations

import difflib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

from corelib.cli.hydra_app import HYDRA_FLAGS, Terminated, plugin_registry, run_command, takes_value
from corelib.errors import ConfigError, CorelibError, one_line
from corelib.version import __version__

USAGE = """usage: python -m corelib COMMAND [MODEL] [group=option ...] [key=value ...] [--help] [--cfg job] [-m]

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
MODEL (a preset, a checkpoint directory or a hub id) stands for model=... or model.path=...;
vLLM's flags (--port, --host, --model, --tensor-parallel-size, --api-key, --max-model-len, --dtype,
--gpu-memory-utilization, --enable-prefix-caching, --seed, ...; bench-serve: --request-rate,
--max-concurrency, --num-prompts, ...) set their keys; COMMAND --help lists them.

examples:
  python -m corelib run Qwen/Qwen3-0.6B 'workload.prompts=["The capital of France is"]'
  python -m corelib serve Qwen/Qwen3-0.6B --port 8001
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

_COMMANDS = ("run", "plan", "backends", "bench", "trace-plot", "serve", "bench-serve")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(USAGE, file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if args[0] in ("-V", "--version", "version") or "--version" in args[1:]:
        print(f"corelib {__version__}")
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


def _hydra_command(command: str, rest: list[str]) -> int:
    from corelib.cli.habits import flags_help, habit_arguments

    arguments = habit_arguments(rest, HYDRA_FLAGS, takes_value, command, warn=_warn)
    code = run_command(command, arguments)
    if {"-h", "--help"} & set(arguments):
        model = ("" if command == "bench-serve" else
                 "\nMODEL: a preset (model=NAME), a checkpoint directory or a hub id (org/name), as the first argument "
                 "or --model MODEL\n")
        print(f"\n== vLLM's flags ==\nusage: python -m corelib {command}"
              f"{'' if command == 'bench-serve' else ' [MODEL]'} [--flag VALUE ...] [key=value ...]\n{model}\n"
              f"Each flag sets the key beside it:\n{flags_help(command)}")
    return code


def _warn(message: str) -> None:
    print(f"corelib: warning: {message}", file=sys.stderr)


def _trace_plot_command(rest: list[str]) -> int:
    from corelib.cli.trace_plot import main as trace_plot

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
    from corelib.cli.commands import print_backends

    print_backends(plugin_registry())
    return 0
