"""The feature gates a config composes: every ``conf/features/*.yaml``, and the gates the plugins ship.

No list names the gates. A gate is one file, ``features/<name>.yaml``, holding one mapping
named ``<name>`` (:class:`corelib.config.schema.FeatureConfig`). :func:`register_gates` finds corelib's
own and takes the plugins' (the ``corelib_feature_configs`` hook), and stores them in Hydra's
ConfigStore as the option ``all`` of the ``features`` group, which ``config.yaml`` selects:
ordered by each gate's ``order``, then by name. One gate is still an option of its own
(``features=[graph,pdl]`` composes those two), and a gate on ``hydra.searchpath`` is added
with ``features=[all,NAME]``.

A gate whose ``mode_key`` is an engine key that no schema declares (``engine.<name>``)
declares it (:func:`corelib.config.schema.declare_gate_keys`), so such a gate needs no Python either.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from corelib.config.schema import declare_gate_keys
from corelib.errors import ConfigError, one_line

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

GROUP = "features"
ALL = "all"  # the option holding every gate: the default of config.yaml


@dataclass(frozen=True)
class GateFile:
    """One gate as read from its file."""

    name: str
    origin: str  # where it came from, for messages: features/<name>.yaml or a plugin's path
    node: DictConfig  # {name: the gate}

    @property
    def order(self) -> int:
        value = self.node[self.name].get("order", 100)
        return value if isinstance(value, int) else 100  # a wrong type is the schema's to name

    @property
    def engine_key(self) -> str | None:
        """``<name>`` when the gate is switched at ``engine.<name>``."""
        mode_key = self.node[self.name].get("mode_key", "")
        head, _, key = str(mode_key).partition(".")
        return key if head == "engine" and key and "." not in key else None


def shipped_gate_files() -> dict[str, Traversable]:
    """corelib's own gates: ``{name: conf/features/<name>.yaml}``."""
    folder = importlib.resources.files("corelib.conf") / GROUP
    return {entry.name[: -len(".yaml")]: entry for entry in folder.iterdir() if entry.name.endswith(".yaml")}


def read_gate(name: str, source: Traversable | Path, origin: str) -> GateFile:
    """The gate in ``source``; a ConfigError unless it holds exactly one mapping named ``name``."""
    try:
        node = OmegaConf.create(source.read_text())
    except (OSError, OmegaConfBaseException) as error:
        raise ConfigError(f"feature gate {origin} cannot be read: {one_line(error)}") from None
    keys = [str(key) for key in node] if isinstance(node, DictConfig) else []
    if not isinstance(node, DictConfig) or keys != [name] or not isinstance(node[name], DictConfig):
        raise ConfigError(f"feature gate {origin} must hold one mapping named {name!r} (found {keys or 'none'})")
    return GateFile(name, origin, node)


def checked_plugin_gates(results: Iterable[Mapping[str, str]], taken: Mapping[str, str]) -> dict[str, Path]:
    """What one plugin's ``corelib_feature_configs`` returned; ``taken``: gates other plugins ship, by plugin."""
    gates: dict[str, Path] = {}
    shipped = shipped_gate_files()
    for result in results:
        for name, raw_path in dict(result).items():
            path = Path(raw_path)
            if name in shipped or name in taken:
                by = f"plugin {taken[name]!r}" if name in taken else "corelib"
                raise ValueError(f"hook corelib_feature_configs returned gate {name!r}, which {by} ships already")
            if not path.is_file():
                raise ValueError(f"hook corelib_feature_configs returned {path}, which is not a file")
            gates[name] = path
    return gates


def load_gates(plugin_files: Mapping[str, Path]) -> list[GateFile]:
    """Every gate, shipped and the plugins', in plan order."""
    gates = [read_gate(name, path, f"features/{name}.yaml") for name, path in shipped_gate_files().items()]
    gates += [read_gate(name, path, str(path)) for name, path in plugin_files.items()]
    return sorted(gates, key=lambda gate: (gate.order, gate.name))


def register_gates(plugin_files: Mapping[str, Path]) -> list[GateFile]:
    """Store the option ``features=all`` and each plugin gate's own option; declare the gates' engine keys."""
    gates = load_gates(plugin_files)
    store = ConfigStore.instance()
    for gate in gates:
        if gate.name in plugin_files:
            store.store(group=GROUP, name=gate.name, node=gate.node)
    store.store(group=GROUP, name=ALL, node=OmegaConf.merge(*(gate.node for gate in gates)) if gates else {})
    declare_gate_keys({gate.engine_key: str(gate.node[gate.name].get("description", "")) for gate in gates
                       if gate.engine_key is not None})
    return gates


def is_registered() -> bool:
    """Whether ``features=all`` is in the ConfigStore (a test may have emptied the group)."""
    return f"{ALL}.yaml" in ConfigStore.instance().repo.get(GROUP, {})
