"""What composing needs of the installed plugins, found without importing them in this process.

Backend plugins ship their backend options (and feature gates) as YAML through hooks, so composing a config needs
the plugins loaded, and loading a plugin imports its backend, which imports torch. A process
that must stay free of torch (the HTTP side of ``python -m corelib serve``) asks a short-lived
child instead: it loads the plugins, as :class:`~corelib.plugins.PluginRegistry` does, and
answers with a :class:`PluginCatalog` (each backend option's YAML, and why the backends that
cannot be selected cannot), as JSON on its stdout.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from corelib.errors import CorelibError, PluginError, one_line
from corelib.trust.isolation import worker_command, worker_environment

if TYPE_CHECKING:
    from corelib.plugins import PluginRegistry

MODULE = "corelib.startup.plugin_catalog"
TIMEOUT_S = 300.0  # importing every plugin imports torch and the vendor extensions: seconds, on a slow disk more


@dataclass(frozen=True)
class PluginCatalog:
    """The backend options and feature gates the plugins ship, and why a plugin's backend cannot be selected."""

    config_files: dict[str, Path] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)  # plugin name -> the error selecting it raises
    feature_files: dict[str, Path] = field(default_factory=dict)  # gate name -> its YAML

    @classmethod
    def of(cls, registry: PluginRegistry) -> PluginCatalog:
        unavailable: dict[str, str] = {}
        for name, record in registry.records.items():
            if record.status == "loaded":
                continue
            try:
                registry.get(name)
            except CorelibError as error:
                unavailable[name] = str(error)
        return cls(registry.config_files, unavailable, registry.feature_files)

    def why_unavailable(self, name: str) -> PluginError | None:
        """The error that ``backend=name`` meets because its plugin did not load; None if that is not why."""
        reason = self.unavailable.get(name)
        return PluginError(reason) if reason is not None else None

    def to_json(self) -> str:
        return json.dumps({"config_files": {name: str(path) for name, path in self.config_files.items()},
                           "unavailable": self.unavailable,
                           "feature_files": {name: str(path) for name, path in self.feature_files.items()}})

    @classmethod
    def from_json(cls, text: str) -> PluginCatalog:
        data = json.loads(text)
        return cls({str(name): Path(path) for name, path in data["config_files"].items()},
                   {str(name): str(reason) for name, reason in data["unavailable"].items()},
                   {str(name): Path(path) for name, path in data["feature_files"].items()})


def read_catalog(allow: Sequence[str] | None, block: Sequence[str], timeout_s: float = TIMEOUT_S) -> PluginCatalog:
    """The catalog of the plugins ``allow`` and ``block`` let load, from a child process."""
    request = json.dumps({"allow": None if allow is None else list(allow), "block": list(block)})
    try:
        done = subprocess.run(worker_command(MODULE), env=worker_environment(), input=request, capture_output=True,
                              text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise CorelibError(f"loading the backend plugins (in a child process) took over {timeout_s:g} s") from None
    sys.stderr.write(done.stderr)  # what a plugin printed while it loaded
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise CorelibError(f"loading the backend plugins (in a child process) failed: {last}")
    try:
        return PluginCatalog.from_json(done.stdout.strip().splitlines()[-1])
    except (IndexError, KeyError, AttributeError, json.JSONDecodeError) as error:
        raise CorelibError(f"the plugin catalog from the child process cannot be read: {one_line(error)}") from None


def main() -> None:
    """Entry point of the child: ``{"allow": [...] | null, "block": [...]}`` on stdin, the catalog on stdout."""
    from corelib.plugins import PluginRegistry

    request = json.loads(sys.stdin.read())
    registry = PluginRegistry(allow=request["allow"], block=request["block"])
    print(PluginCatalog.of(registry).to_json(), flush=True)


if __name__ == "__main__":
    main()
