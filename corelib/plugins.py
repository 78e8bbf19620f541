"""Backend plugins: the hook specification and their discovery through entry points.

Every backend, built in or third party, is a plugin found through the entry-point group
``corelib.backends``; the core never imports one by name. A plugin module implements the
hooks below with ``@hookimpl``.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy

from corelib.backend import Backend
from corelib.errors import PluginError, one_line

PROJECT = "corelib"
ENTRY_POINT_GROUP = "corelib.backends"
ENV_ALLOW = "CORELIB_PLUGINS"
ENV_BLOCK = "CORELIB_BLOCK_PLUGINS"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class BackendHookSpecs:
    """The hooks a backend plugin may implement. Hooks are called with keyword arguments."""

    @hookspec
    def corelib_backends(self) -> Sequence[Backend]:
        """Return the backends this plugin provides.

        Return rule: results of all plugins are collected; each backend name may be claimed by
        one plugin only, or loading fails naming both.
        """
        raise NotImplementedError

    @hookspec
    def corelib_backend_configs(self) -> dict[str, str]:
        """Return ``{backend name: path to its YAML}`` for configs outside corelib's ``conf/``.

        Return rule: results of all plugins are collected; the YAML becomes the option
        ``backend=<name>`` and is validated like the built-in ones.
        """
        raise NotImplementedError


@dataclass
class PluginRecord:
    """One entry point of the group and what became of it."""

    name: str
    distribution: str
    status: str  # loaded, failed or blocked
    error: str = ""
    backends: list[str] = field(default_factory=list)


def _env_list(name: str) -> list[str] | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    return [item.strip() for item in raw.split(",") if item.strip()]


class PluginRegistry:
    """Loads the plugins of the entry-point group and indexes their backends by name."""

    def __init__(
        self,
        allow: Iterable[str] | None = None,
        block: Iterable[str] = (),
        entry_points: Iterable[importlib.metadata.EntryPoint] | None = None,
    ) -> None:
        env_allow = _env_list(ENV_ALLOW)
        self.allow = set(allow) if allow is not None else (set(env_allow) if env_allow is not None else None)
        self.block = set(block) | set(_env_list(ENV_BLOCK) or [])
        self.manager = pluggy.PluginManager(PROJECT)
        self.manager.add_hookspecs(BackendHookSpecs)
        self.records: dict[str, PluginRecord] = {}
        self._backends: dict[str, tuple[Backend, str]] = {}
        self._configs: dict[str, Path] = {}
        if entry_points is None:
            entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        for entry_point in sorted(entry_points, key=lambda ep: ep.name):
            self._load(entry_point)

    def _load(self, entry_point: importlib.metadata.EntryPoint) -> None:
        dist = entry_point.dist
        distribution = f"{dist.name} {dist.version}" if dist is not None else "unknown distribution"
        record = self._new_record(entry_point.name, distribution)
        if entry_point.name in self.block or (self.allow is not None and entry_point.name not in self.allow):
            record.status = "blocked"
            record.error = f"not loaded: restricted by {ENV_ALLOW}/{ENV_BLOCK} or plugins.allow/block"
            return
        try:
            plugin = entry_point.load()
        except Exception as error:  # noqa: BLE001 - a broken plugin is reported, not fatal
            record.status = "failed"
            record.error = one_line(error)
            return
        self._add(plugin, record)

    def register(self, plugin: ModuleType | object, name: str) -> None:
        """Register a plugin object directly (for embedding); the same rules as entry points."""
        record = self._new_record(name, "registered in process")
        self._add(plugin, record)
        if record.status == "failed":
            raise PluginError(f"plugin {name!r} failed to register: {record.error}")

    def _new_record(self, name: str, distribution: str) -> PluginRecord:
        if name in self.records:
            raise PluginError(
                f"two plugins are named {name!r}: {self.records[name].distribution} and {distribution}; "
                f"uninstall one or block it with {ENV_BLOCK}"
            )
        record = PluginRecord(name, distribution, "loaded")
        self.records[name] = record
        return record

    def _add(self, plugin: object, record: PluginRecord) -> None:
        try:
            self.manager.register(plugin, name=record.name)
            backends = [b for result in self._call(record.name, "corelib_backends") for b in result]
            configs = [c for result in self._call(record.name, "corelib_backend_configs") for c in result.items()]
            for backend in backends:
                if not isinstance(backend, Backend):
                    raise TypeError(
                        f"hook corelib_backends returned {type(backend).__name__}; expected a corelib Backend"
                    )
        except Exception as error:  # noqa: BLE001 - a broken plugin is reported, not fatal
            record.status = "failed"
            record.error = one_line(error)
            if self.manager.has_plugin(record.name):
                self.manager.unregister(name=record.name)
            return
        for backend in backends:
            self._claim(backend, record.name)
            record.backends.append(backend.name)
        for name, path in configs:
            self._configs[name] = Path(path)

    def _call(self, plugin_name: str, hook_name: str) -> list[Any]:
        others = [p for p in self.manager.get_plugins() if self.manager.get_name(p) != plugin_name]
        caller = self.manager.subset_hook_caller(hook_name, remove_plugins=others)
        try:
            return list(caller())
        except Exception as error:
            raise RuntimeError(f"plugin {plugin_name!r}, hook {hook_name}: {one_line(error)}") from error

    def _claim(self, backend: Backend, plugin_name: str) -> None:
        if backend.name in self._backends:
            owner = self._backends[backend.name][1]
            raise PluginError(
                f"backend {backend.name!r} is claimed by two plugins, {owner!r} and {plugin_name!r}; "
                f"block one with {ENV_BLOCK}={plugin_name}"
            )
        self._backends[backend.name] = (backend, plugin_name)

    @property
    def backend_names(self) -> list[str]:
        return sorted(self._backends)

    @property
    def config_files(self) -> dict[str, Path]:
        return dict(self._configs)

    def has(self, name: str) -> bool:
        return name in self._backends

    def plugin_of(self, backend_name: str) -> str:
        return self._backends[backend_name][1]

    def get(self, name: str) -> Backend:
        """The backend called ``name``, or a PluginError saying why it is not there."""
        if name in self._backends:
            return self._backends[name][0]
        record = self.records.get(name)
        if record is not None and record.status != "loaded":
            raise PluginError(f"backend {name!r}: plugin {record.name!r} {record.status}: {record.error}")
        installed = ", ".join(self.backend_names) or "none"
        raise PluginError(
            f"no installed plugin provides backend {name!r}; installed backends: {installed} "
            f"(plugins are found through the entry-point group {ENTRY_POINT_GROUP!r})"
        )
