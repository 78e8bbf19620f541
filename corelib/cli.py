"""``python -m corelib {run,plan,backends,bench} [hydra overrides]``, and ``trace-plot``.

Exit codes: 0 success, 2 bad configuration or a refused plan, 1 runtime failure, 130 on
Ctrl-C. A user error prints one line (``HYDRA_FULL_ERROR=1`` shows the traceback).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from corelib.errors import ConfigError, CorelibError

if TYPE_CHECKING:
    from corelib.plugins import PluginRegistry

USAGE = """usage: python -m corelib COMMAND [hydra overrides] [--help] [--cfg job] [-m]

commands:
  run       run the workload through the engine and write outputs into the run directory
  plan      show which features are enabled and why, without running
  backends  list installed backend plugins and whether they run natively, emulated, or not at all
  bench     sweep batch size, handoff, transport and backend; print a table, write bench.json
  trace-plot  render decode steps of trace.json files (engine.trace=true) into a PNG (trace-plot --help)

examples:
  python -m corelib run backend=npu engine.async_token_handoff=on workload.num_requests=64
  python -m corelib plan backend=cuda backend.runtime=emulated
  python -m corelib run --help"""

_HYDRA_FLAGS = ("-h", "--help", "--hydra-help", "--cfg", "-c", "--info", "-i", "-m", "--multirun",
                "--resolve", "--package", "-p", "--version", "--shell-completion", "-sc",
                "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
                "--experimental-rerun")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    commands: dict[str, Callable[[list[str]], int]] = {
        "run": lambda r: _hydra_command("run", r),
        "plan": lambda r: _hydra_command("plan", r),
        "bench": lambda r: _hydra_command("bench", r),
        "backends": _backends_command,
        "trace-plot": _trace_plot_command,
    }
    if command not in commands:
        return _report(ConfigError(f"unknown command {command!r}; expected one of {', '.join(commands)}"))
    try:
        return commands[command](rest)
    except CorelibError as error:
        return _report(error)
    except KeyboardInterrupt:
        print("corelib: interrupted", file=sys.stderr)
        return 130


def _report(error: CorelibError) -> int:
    if _full_error():
        raise error
    for line in str(error).splitlines() or [type(error).__name__]:
        print(f"corelib: error: {line}", file=sys.stderr)
    return error.exit_code


def _full_error() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def _registry() -> PluginRegistry:
    from corelib.compose import prepare_config_store
    from corelib.plugins import PluginRegistry

    registry = PluginRegistry()
    prepare_config_store(registry)
    return registry


def _hydra_command(command: str, rest: list[str]) -> int:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from corelib.compose import compose_config

    registry = _registry()
    if not any(arg.split("=")[0] in _HYDRA_FLAGS for arg in rest):
        compose_config(rest)  # fail early, in one line, on a bad override

    def task(cfg: DictConfig) -> None:
        output_dir = Path(HydraConfig.get().runtime.output_dir)
        try:
            _tasks()[command](cfg, registry, output_dir)
        except CorelibError as error:
            sys.exit(_report(error))
        except KeyboardInterrupt:
            print("corelib: interrupted; resources released", file=sys.stderr)
            sys.exit(130)

    app = hydra.main(config_path="pkg://corelib.conf", config_name="config", version_base="1.3")(task)
    if not any(arg.startswith("hydra.job.name=") for arg in rest):
        rest = [*rest, f"hydra.job.name={command}"]
    saved = sys.argv
    sys.argv = [f"corelib {command}", *rest]
    try:
        app()
    finally:
        sys.argv = saved
    return 0


def _tasks() -> dict[str, Callable[[DictConfig, PluginRegistry, Path], None]]:
    from corelib.commands import bench_task, plan_task, run_task

    return {"run": run_task, "plan": plan_task, "bench": bench_task}


def _trace_plot_command(rest: list[str]) -> int:
    from corelib.trace_plot import main as trace_plot

    return trace_plot(rest)


def _backends_command(rest: list[str]) -> int:
    from corelib.commands import print_backends

    if rest:
        raise ConfigError(f"backends takes no arguments (got {' '.join(rest)}); restrict plugins with CORELIB_PLUGINS")
    print_backends(_registry())
    return 0


