"""The bodies of the CLI commands; each gets a composed config and its output directory."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from corelib.device import Runtime
from corelib.features import Plan
from corelib.plugins import PluginRegistry
from corelib.rundir import RunDir
from corelib.startup import Startup, start

console = Console(highlight=False, width=None if sys.stdout.isatty() else 120)


def plan_table(plan: Plan) -> Table:
    table = Table(title="feature plan", show_lines=False)
    table.add_column("feature")
    table.add_column("mode")
    table.add_column("decision")
    table.add_column("reasons")
    for decision in plan.decisions.values():
        verdict = "[green]enabled[/green]" if decision.enabled else "[yellow]disabled[/yellow]"
        reasons = "\n".join(decision.reasons)
        if decision.enabled and decision.step_requirements:
            reasons += "\nper step, synchronous when: " + "; ".join(r.reason for r in decision.step_requirements)
        table.add_row(decision.feature, f"{decision.mode_key}={decision.mode_value}", verdict, reasons)
    return table


def announce(startup: Startup) -> None:
    for message in startup.messages:
        console.print(f"corelib: {message}")


def plan_task(cfg: DictConfig, registry: PluginRegistry, output_dir: Path) -> None:
    startup = start(cfg, registry)
    announce(startup)
    console.print(plan_table(startup.plan))
    run_dir = RunDir(output_dir)
    run_dir.write_config(startup.raw)
    run_dir.write_plan(startup.plan, startup.messages)


def run_task(cfg: DictConfig, registry: PluginRegistry, output_dir: Path) -> None:
    from corelib.run import run

    startup = start(cfg, registry)
    announce(startup)
    run(startup, RunDir(output_dir), console)


def bench_task(cfg: DictConfig, registry: PluginRegistry, output_dir: Path) -> None:
    from corelib.bench import bench

    bench(cfg, registry, RunDir(output_dir), console)


def print_backends(registry: PluginRegistry) -> None:
    table = Table(title="backend plugins (entry-point group corelib.backends)")
    table.add_column("plugin")
    table.add_column("backend")
    table.add_column("availability")
    table.add_column("reason")
    table.add_column("distribution")
    for record in registry.records.values():
        if record.status != "loaded":
            table.add_row(record.name, "-", f"[red]{record.status}[/red]", record.error, record.distribution)
            continue
        for name in record.backends:
            backend = registry.get(name)
            availability = backend.probe()
            if availability.native:
                status = f"[green]{Runtime.native.value}[/green]"
            elif backend.can_emulate:
                status = f"[yellow]{Runtime.emulated.value}[/yellow]"
            else:
                status = "[red]unavailable[/red]"
            table.add_row(record.name, name, status, availability.reason, record.distribution)
    console.print(table)
