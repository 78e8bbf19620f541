"""The bodies of the CLI commands; each gets a composed config and its output directory."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from corelib.config.features import Plan
from corelib.errors import ConfigError, CorelibError
from corelib.observe.rundir import RunDir
from corelib.platform.device import Runtime
from corelib.plugins import ENTRY_POINT_GROUP, ENV_ALLOW, ENV_BLOCK, PluginRegistry
from corelib.startup.start import Startup, start
from corelib.support.progress import Progress, reporting, say, show

# Status (what was chosen, progress, where files went) goes to stderr; what a command produces (the
# generated text, the plan, the backends table) to stdout, so `run ... > answers.txt` keeps only text.
# A pipe or a file gets a fixed width, so captured output does not depend on the terminal.
console = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 200)
output = Console(highlight=False, width=None if sys.stdout.isatty() else 200)


def plan_table(plan: Plan, combinations: bool = False) -> Table:
    """The decision table; ``combinations``: also how each enabled gate works with the other enabled ones."""
    table = Table(title="feature plan", show_lines=False)
    table.add_column("feature")
    table.add_column("mode")
    table.add_column("decision")
    table.add_column("reasons")
    for decision in plan.decisions.values():
        verdict = "[green]enabled[/green]" if decision.enabled else "[yellow]disabled[/yellow]"
        reasons = "\n".join(decision.reasons)
        if decision.enabled and decision.step_requirements:
            per_step = "; ".join(r.reason for r in decision.step_requirements)
            reasons += f"\nper step, synchronous when: {per_step}"
        if combinations and decision.enabled:
            reasons += "".join(f"\nwith {other}: {rule}" for other, rule in decision.combines if plan.is_enabled(other))
        table.add_row(decision.feature, f"{decision.mode_key}={decision.mode_value}", verdict, reasons)
    return table


def announce(startup: Startup) -> None:
    for message in startup.messages:
        say(console, message)


def prepare(cfg: DictConfig, registry: PluginRegistry, output_dir: Path) -> tuple[Startup, RunDir]:
    """Start, say what was chosen, and write ``config.yaml`` and ``plan.json``: every run has them."""
    startup = start(cfg, registry)
    announce(startup)
    run_dir = RunDir(output_dir)
    run_dir.record_startup(startup)
    return startup, run_dir


def plan_task(cfg: DictConfig, registry: PluginRegistry, output_dir: Path) -> None:
    from corelib.startup.kv_pool import describe_policy

    startup, run_dir = prepare(cfg, registry, output_dir)
    say(console, describe_policy(startup))
    show(output, plan_table(startup.plan, combinations=True))
    say(console, f"wrote {run_dir.path}/{{config.yaml,plan.json}}")


def run_task(cfg: DictConfig, registry: PluginRegistry, output_dir: Path) -> None:
    from corelib.cli.run import run

    startup, run_dir = prepare(cfg, registry, output_dir)
    if followed(startup):
        return
    with reporting(Progress(console)):
        run(startup, run_dir, console, output)


def followed(startup: Startup) -> bool:
    """On a node other than 0 of a multi-node run: serve node 0's steps until it stops, then True."""
    from corelib.transport.follower import follow

    return follow(startup, lambda line: say(console, line))


def bench_task(cfg: DictConfig, registry: PluginRegistry, output_dir: Path) -> None:
    from corelib.cli.bench import bench
    from corelib.transport.launch import launched_nodes

    nodes = launched_nodes()
    if nodes > 1:
        raise ConfigError(f"bench measures one node, and torchrun started {nodes}: run it without torchrun, "
                          "or with --nnodes=1")
    with reporting(Progress(console)):
        bench(cfg, registry, RunDir(output_dir), console)


def serve_follower_task(cfg: DictConfig, registry: PluginRegistry, output_dir: Path) -> None:
    """``serve`` on a node other than 0: no HTTP server here; this node follows node 0's steps."""
    from corelib.server.command import check_serve_modules, without_api_key

    check_serve_modules()
    startup, _ = prepare(without_api_key(cfg)[0], registry, output_dir)
    if not followed(startup):
        raise CorelibError("serve_follower_task runs on a node other than 0 only")


def bench_serve_task(cfg: DictConfig, registry: PluginRegistry, output_dir: Path) -> None:
    from corelib.server.command import check_serve_modules

    check_serve_modules()
    from omegaconf import OmegaConf

    from corelib.config.schema import ServeBenchConfig
    from corelib.loadtest.loadgen import bench_serve

    spec = OmegaConf.to_object(cfg.server.bench)
    if not isinstance(spec, ServeBenchConfig):
        raise ConfigError("server.bench does not follow its schema; keep server: default in the defaults list")
    bench_serve(spec, RunDir(output_dir), console)


def backends_table(registry: PluginRegistry) -> Table:
    """One row per backend (or per plugin that did not load), probing each backend once."""
    table = Table(title=f"backend plugins (entry-point group {ENTRY_POINT_GROUP})")
    table.add_column("plugin")
    table.add_column("backend")
    table.add_column("availability")
    table.add_column("reason")
    table.add_column("distribution")
    conflicts = registry.conflicts
    for record in registry.records.values():
        if record.status != "loaded":
            table.add_row(record.name, "-", f"[red]{record.status}[/red]", record.error, record.distribution)
            continue
        for name in record.backends:
            if name in conflicts:
                others = ", ".join(p for p in conflicts[name] if p != record.name)
                reason = f"{name!r} is also claimed by plugin {others}; selecting it fails"
                table.add_row(record.name, name, "[red]conflict[/red]", reason, record.distribution)
                continue
            backend = registry.get(name)
            availability = backend.probe()
            if availability.native:
                status = f"[green]{Runtime.native.value}[/green]"
            elif backend.can_emulate:
                status = f"[yellow]{Runtime.emulated.value}[/yellow]"
            else:
                status = "[red]unavailable[/red]"
            table.add_row(record.name, name, status, availability.reason, record.distribution)
    return table


def print_backends(registry: PluginRegistry) -> None:
    if not registry.records:
        output.print(
            f"no backend plugins are installed (entry-point group {ENTRY_POINT_GROUP}); "
            "install one, e.g. pip install -e backends/cpu",
            soft_wrap=True,
        )
        return
    output.print(backends_table(registry))
    output.print(
        "native: runs on its hardware; emulated: no hardware here, runs on the stream emulator with the "
        "backend's profile (the reason says why it is not native). Select one with backend=NAME; "
        f"restrict loading with {ENV_ALLOW} or {ENV_BLOCK}.",
        soft_wrap=True,
    )
