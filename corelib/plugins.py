"""Backend plugins: the hook specification and their discovery through entry points.

Every backend, built in or third party, is a plugin found through the entry-point group
``corelib.backends``; the core never imports one by name. A plugin module implements the
hooks below with ``@hookimpl``. A plugin that fails to load, whatever it raises (SystemExit and
KeyboardInterrupt included, unless a real signal caused them), or whose name another installed
distribution also registers, is recorded and skipped: it only becomes an error when its
backend is selected.

Long: it is one contract, the hook specification, with the discovery that enforces it (loading,
duplicate names, timeouts, the errors recorded per plugin).
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import os
import signal
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import pluggy

from corelib.config.gate_catalog import checked_plugin_gates
from corelib.errors import PluginError, one_line
from corelib.models.registry import Architecture
from corelib.models.registry import register as register_architecture
from corelib.platform.backend import Backend

PROJECT = "corelib"
ENTRY_POINT_GROUP = "corelib.backends"
ENV_ALLOW = "CORELIB_PLUGINS"
ENV_BLOCK = "CORELIB_BLOCK_PLUGINS"
HOOK_TIMEOUT_S = 60.0  # one plugin's hook: returning a few objects takes microseconds

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class BackendHookSpecs:
    """The hooks a backend plugin may implement. Hooks are called with keyword arguments."""

    @hookspec
    def corelib_backends(self) -> Sequence[Backend]:
        """Return the backends this plugin provides.

        Return rule: results of all plugins are collected; each backend name may be claimed by
        one plugin only, or selecting that backend fails naming both.
        """
        raise NotImplementedError

    @hookspec
    def corelib_backend_configs(self) -> dict[str, str]:
        """Return ``{backend name: path to its YAML}`` for configs outside corelib's ``conf/``.

        Return rule: results of all plugins are collected; a plugin may only ship configs for
        backends it provides. The YAML becomes the option ``backend=<name>`` and is validated
        like the built-in ones.
        """
        raise NotImplementedError

    @hookspec
    def corelib_feature_configs(self) -> dict[str, str]:
        """Return ``{gate name: path to its YAML}``: feature gates that join the default ``features=all``.

        Return rule: results of all plugins are collected; a name may be taken once (corelib's
        own ``conf/features`` included). Each YAML is validated like the built-in gates.
        """
        raise NotImplementedError

    @hookspec
    def corelib_models(self) -> Sequence[Architecture]:
        """Return model architectures this plugin adds (``model.architecture=<name>``).

        Return rule: results of all plugins are collected; a name may be taken once (the
        built-in Llama-family variants of ``corelib.models.registry`` included).
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
    package: str = ""  # the plugin's own package: config ``_target_``s may point into it


def _env_list(name: str) -> list[str] | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    return [item.strip() for item in raw.split(",") if item.strip()]


def _distribution(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = entry_point.dist
    return f"{dist.name} {dist.version}" if dist is not None else "unknown distribution"


def _identity(entry_point: importlib.metadata.EntryPoint) -> tuple[str, str]:
    dist = entry_point.dist
    return entry_point.value, dist.name if dist is not None else ""


def _package_of(module: str) -> str:
    """``corelib_cpu.plugin`` -> ``corelib_cpu``; a top-level module is its own package."""
    return module.rpartition(".")[0] or module


def _shipped_backend_configs() -> set[str]:
    """Backend options that ship in corelib's ``conf/backend`` (``auto``); a plugin YAML cannot replace them."""
    try:
        folder = importlib.resources.files("corelib.conf") / "backend"
        return {entry.name[: -len(".yaml")] for entry in folder.iterdir() if entry.name.endswith(".yaml")}
    except (ModuleNotFoundError, OSError):
        return set()


class PluginRegistry:
    """Loads the plugins of the entry-point group and indexes their backends by name.

    ``allow``/``block`` (the ``plugins`` config keys) and the environment variables
    ``CORELIB_PLUGINS``/``CORELIB_BLOCK_PLUGINS`` all restrict loading: a plugin loads only if
    every allow list that is set names it and no block list does.
    """

    def __init__(
        self,
        allow: Iterable[str] | None = None,
        block: Iterable[str] = (),
        entry_points: Iterable[importlib.metadata.EntryPoint] | None = None,
    ) -> None:
        self._allow_lists: list[tuple[str, set[str]]] = []
        env_allow = _env_list(ENV_ALLOW)
        if env_allow is not None:
            self._allow_lists.append((ENV_ALLOW, set(env_allow)))
        if allow is not None:
            self._allow_lists.append(("plugins.allow", set(allow)))
        self._block_lists = [(ENV_BLOCK, set(_env_list(ENV_BLOCK) or [])), ("plugins.block", set(block))]
        self.manager = pluggy.PluginManager(PROJECT)
        self.manager.add_hookspecs(BackendHookSpecs)
        self.records: dict[str, PluginRecord] = {}
        self._backends: dict[str, tuple[Backend, str]] = {}
        self._conflicts: dict[str, list[str]] = {}
        self._configs: dict[str, Path] = {}
        self._features: dict[str, tuple[Path, str]] = {}  # gate -> its YAML, the plugin that ships it
        self._shipped_configs = _shipped_backend_configs()
        self._signals: list[int] = []  # signals that arrived while plugin code ran
        if entry_points is None:
            entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        by_name: dict[str, list[importlib.metadata.EntryPoint]] = {}
        for entry_point in sorted(entry_points, key=lambda ep: ep.name):
            same = by_name.setdefault(entry_point.name, [])
            # The same distribution seen twice on sys.path is one plugin, not two.
            if not any(_identity(entry_point) == _identity(seen) for seen in same):
                same.append(entry_point)
        for name, points in by_name.items():
            if len(points) == 1:
                self._load(points[0])
            else:
                self._ambiguous(name, points)

    def _restriction(self, name: str) -> str:
        """Why plugin ``name`` may not load, or "" if it may."""
        for source, names in self._block_lists:
            if name in names:
                return f"blocked by {source}"
        for source, names in self._allow_lists:
            if name not in names:
                return f"not in {source} ({', '.join(sorted(names)) or 'empty'})"
        return ""

    def _load(self, entry_point: importlib.metadata.EntryPoint) -> None:
        record = self._new_record(entry_point.name, _distribution(entry_point))
        record.package = _package_of(entry_point.module)
        restriction = self._restriction(entry_point.name)
        if restriction:
            record.status = "blocked"
            record.error = restriction
            return
        with self._watching_signals():
            try:
                plugin = entry_point.load()
            except BaseException as error:  # noqa: BLE001 - whatever a plugin raises, it is reported and skipped
                self._unless_signalled(error)
                record.status = "failed"
                record.error = f"import of {entry_point.value} failed: {one_line(error)}"
                return
            self._add(plugin, record)

    def _ambiguous(self, name: str, entry_points: list[importlib.metadata.EntryPoint]) -> None:
        """Several distributions register one plugin name: none of them is imported, the rest load as usual."""
        distributions = [_distribution(ep) for ep in entry_points]
        record = self._new_record(name, " and ".join(distributions))
        restriction = self._restriction(name)
        record.status = "blocked" if restriction else "failed"
        record.error = restriction or (
            f"{len(entry_points)} installed distributions register plugin {name!r} ({', '.join(distributions)}); "
            "corelib cannot tell which one is meant: uninstall all but one"
        )

    @contextmanager
    def _watching_signals(self) -> Iterator[None]:
        """Note Ctrl-C and SIGTERM while plugin code runs, and still let their handlers act.

        A plugin that raises KeyboardInterrupt or SystemExit itself is a broken plugin and is
        skipped; the same exception caused by a real signal must stop corelib as usual.
        """
        self._signals = []
        if threading.current_thread() is not threading.main_thread():
            yield  # signals are delivered to the main thread only
            return
        previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
        watched = {int(signum): handler for signum, handler in previous.items() if handler is not None}

        def notice(signum: int, frame: FrameType | None) -> None:
            self._signals.append(signum)
            handler = watched[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)

        for signum in watched:
            signal.signal(signum, notice)
        try:
            yield
        finally:
            for signum, handler in watched.items():
                signal.signal(signum, handler)

    def _unless_signalled(self, error: BaseException) -> None:
        """Re-raise ``error`` when a signal caused it; otherwise the caller records the plugin as failed."""
        if self._signals:
            raise error

    def register(self, plugin: ModuleType | object, name: str) -> None:
        """Register a plugin object directly (for embedding); the same rules as entry points."""
        record = self._new_record(name, "registered in process")
        module = plugin.__name__ if isinstance(plugin, ModuleType) else type(plugin).__module__
        record.package = _package_of(module)
        restriction = self._restriction(name)
        if restriction:
            record.status = "blocked"
            record.error = restriction
            return
        with self._watching_signals():
            self._add(plugin, record)
        if record.status == "failed":
            raise PluginError(f"plugin {name!r} failed to register: {record.error}")

    def _new_record(self, name: str, distribution: str) -> PluginRecord:
        if name in self.records:
            raise PluginError(
                f"two plugins are named {name!r}: {self.records[name].distribution} and {distribution}; "
                "uninstall one of them"
            )
        record = PluginRecord(name, distribution, "loaded")
        self.records[name] = record
        return record

    def _add(self, plugin: object, record: PluginRecord) -> None:
        try:
            self.manager.register(plugin, name=record.name)
            # A misspelled hook (corelib_backend) would otherwise be ignored without a word.
            self.manager.check_pending()
            backends = [b for result in self._call(record.name, "corelib_backends") for b in result]
            for backend in backends:
                if not isinstance(backend, Backend):
                    raise TypeError(
                        f"hook corelib_backends returned a {type(backend).__name__}; "
                        "expected instances of corelib.backend.Backend"
                    )
            architectures = [a for result in self._call(record.name, "corelib_models") for a in result]
            gates = self._gates_of(record.name)
            if not backends and not architectures and not gates:
                raise TypeError("it provides no backend, model or feature gate (implement one of the corelib_* hooks)")
            configs = self._configs_of(record.name, [b.name for b in backends])
            for architecture in architectures:
                register_architecture(architecture, f"plugin {record.name!r}")
        except BaseException as error:  # noqa: BLE001 - a broken plugin is reported, not fatal
            self._unless_signalled(error)
            record.status = "failed"
            record.error = one_line(error)
            if self.manager.has_plugin(record.name):
                self.manager.unregister(name=record.name)
            return
        for backend in backends:
            self._claim(backend, record.name)
            record.backends.append(backend.name)
        self._configs.update(configs)
        self._features.update({name: (path, record.name) for name, path in gates.items()})

    def _gates_of(self, plugin_name: str) -> dict[str, Path]:
        taken = {name: plugin for name, (_, plugin) in self._features.items()}
        return checked_plugin_gates(self._call(plugin_name, "corelib_feature_configs"), taken)

    def _configs_of(self, plugin_name: str, own_backends: list[str]) -> dict[str, Path]:
        configs: dict[str, Path] = {}
        for result in self._call(plugin_name, "corelib_backend_configs"):
            for name, raw_path in dict(result).items():
                path = Path(raw_path)
                if name not in own_backends:
                    raise ValueError(
                        f"hook corelib_backend_configs returned a config for backend {name!r}, "
                        f"which the plugin does not provide ({', '.join(own_backends)})"
                    )
                if name in self._shipped_configs:
                    raise ValueError(
                        f"backend/{name}.yaml ships with corelib; the plugin's {path} cannot replace it"
                    )
                if not path.is_file():
                    raise ValueError(f"hook corelib_backend_configs returned {path}, which is not a file")
                configs[name] = path
        return configs

    def _call(self, plugin_name: str, hook_name: str) -> list[Any]:
        """One plugin's results of a hook, within :data:`HOOK_TIMEOUT_S`: a hook that never returns fails the plugin.

        The hook runs on a thread of its own, which is left behind if it never returns (Python cannot
        stop a thread); the wait for it is a plain join, so Ctrl-C and SIGTERM still stop corelib.
        """
        others = [p for p in self.manager.get_plugins() if self.manager.get_name(p) != plugin_name]
        caller = self.manager.subset_hook_caller(hook_name, remove_plugins=others)
        outcome: list[tuple[bool, Any]] = []

        def call() -> None:
            try:
                outcome.append((True, list(caller())))
            except BaseException as error:  # noqa: BLE001 - SystemExit from a hook: the plugin's failure too
                outcome.append((False, error))

        worker = threading.Thread(target=call, name=f"corelib-plugin-{plugin_name}-{hook_name}", daemon=True)
        worker.start()
        worker.join(HOOK_TIMEOUT_S)
        if not outcome:
            raise RuntimeError(f"hook {hook_name} did not return within {HOOK_TIMEOUT_S:g} s; a hook returns its "
                               "backends at once (a backend's probe() is where to look for devices)")
        returned, value = outcome[0]
        if not returned:
            self._unless_signalled(value)
            raise RuntimeError(f"hook {hook_name} raised {one_line(value)}") from value
        return list(value)

    def _claim(self, backend: Backend, plugin_name: str) -> None:
        if backend.name in self._conflicts:
            self._conflicts[backend.name].append(plugin_name)
        elif backend.name in self._backends:
            self._conflicts[backend.name] = [self._backends.pop(backend.name)[1], plugin_name]
        else:
            self._backends[backend.name] = (backend, plugin_name)

    @property
    def backend_names(self) -> list[str]:
        """Backends that can be selected: loaded, and claimed by one plugin only."""
        return sorted(self._backends)

    @property
    def conflicts(self) -> dict[str, list[str]]:
        """Backend names claimed by more than one plugin, with the plugins that claim them."""
        return {name: list(plugins) for name, plugins in self._conflicts.items()}

    @property
    def config_files(self) -> dict[str, Path]:
        return dict(self._configs)

    @property
    def feature_files(self) -> dict[str, Path]:  # the gates the loaded plugins ship
        return {name: path for name, (path, _) in self._features.items()}

    @property
    def trusted_packages(self) -> list[str]:
        """Packages whose objects a config ``_target_`` may build: corelib and the loaded plugins."""
        loaded = {r.package for r in self.records.values() if r.status == "loaded" and r.package}
        return sorted({PROJECT, *loaded})

    def has(self, name: str) -> bool:
        return name in self._backends

    def plugin_of(self, backend_name: str) -> str:
        return self._backends[backend_name][1]

    def get(self, name: str) -> Backend:
        """The backend called ``name``, or a PluginError saying why it is not there."""
        if name in self._backends:
            return self._backends[name][0]
        if name in self._conflicts:
            claims = " and ".join(
                f"{plugin!r} ({self.records[plugin].distribution})" for plugin in self._conflicts[name]
            )
            raise PluginError(
                f"backend {name!r} is claimed by two plugins, {claims}; uninstall one or block it "
                f"with {ENV_BLOCK}={self._conflicts[name][-1]}"
            )
        record = self.records.get(name)
        if record is not None and record.status == "blocked":
            raise PluginError(
                f"backend {name!r}: plugin {name!r} is not loaded ({record.error}); lift that restriction"
            )
        if record is not None and record.status == "failed":
            raise PluginError(
                f"backend {name!r}: plugin {name!r} ({record.distribution}) failed to load: {record.error}; "
                "fix or reinstall it"
            )
        installed = ", ".join(self.backend_names) or "none"
        unloaded = [f"{r.name} ({r.status})" for r in self.records.values() if r.status != "loaded"]
        also = f"; plugins not loaded: {', '.join(unloaded)}" if unloaded else ""
        raise PluginError(
            f"no installed plugin provides backend {name!r}; installed backends: {installed}{also} "
            f"(plugins are found through the entry-point group {ENTRY_POINT_GROUP!r})"
        )
