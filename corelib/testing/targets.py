"""Which backend x runtime combinations the conformance suite runs against, and how to open one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from omegaconf import OmegaConf

from corelib.config.schema import CorelibConfig, RuntimeMode
from corelib.errors import ConfigError
from corelib.platform.backend import DeviceSpec, resolve_runtime
from corelib.plugins import PluginRegistry
from corelib.startup.compose import compose_config, prepare_config_store


@dataclass(frozen=True)
class Target:
    """One backend on one runtime, with the emulator's chaos setting where it is emulated."""

    backend: str
    runtime: RuntimeMode
    chaos: float = 0.0
    seed: int = 0
    hardware_mark: str | None = None  # the pytest marker of the hardware a native run needs

    @property
    def id(self) -> str:
        chaos = f"-chaos{self.chaos:g}" if self.runtime is RuntimeMode.emulated and self.chaos > 0 else ""
        return f"{self.backend}-{self.runtime.value}{chaos}"


def discover_targets(
    registry: PluginRegistry,
    backends: Sequence[str] = (),
    runtime: RuntimeMode | None = None,
    chaos: float = 0.0,
    seed: int = 0,
) -> list[Target]:
    """Every requested backend on every runtime it has here.

    Without ``runtime``: the emulated runtime where the backend can be emulated (plus a
    chaos run when ``chaos`` > 0), and the native runtime where its probe finds hardware or
    it cannot be emulated at all. An explicit ``runtime`` is taken as asked; a native target
    without hardware then skips with the probe's reason.
    """
    targets: list[Target] = []
    for name in backends or registry.backend_names:
        backend = registry.get(name)
        if runtime is not None:
            runtimes = [runtime]
        else:
            runtimes = [RuntimeMode.emulated] if backend.can_emulate else []
            if not backend.can_emulate or backend.probe().native:
                runtimes.append(RuntimeMode.native)
        for mode in runtimes:
            mark = backend.hardware_mark if mode is RuntimeMode.native else None
            targets.append(Target(name, mode, seed=seed, hardware_mark=mark))
            if mode is RuntimeMode.emulated and chaos > 0:
                targets.append(Target(name, mode, chaos=chaos, seed=seed))
    return targets


def resolve_spec(target: Target, registry: PluginRegistry, timeout_s: float) -> DeviceSpec:
    """Compose the backend's config for ``target`` and choose its runtime, as a run would.

    Raises BackendUnavailable when the runtime cannot be had here (no hardware).
    """
    prepare_config_store(registry)
    overrides = [f"backend={target.backend}", f"backend.runtime={target.runtime.value}"]
    if target.runtime is RuntimeMode.emulated:
        overrides += [f"backend.emulator.chaos={target.chaos}", f"backend.emulator.seed={target.seed}"]
    config = OmegaConf.to_object(compose_config(overrides))
    if not isinstance(config, CorelibConfig):
        raise ConfigError("the composed config does not follow the corelib schema")
    return resolve_runtime(registry.get(target.backend), config.backend, timeout_s).spec
