"""From a composed config to a chosen backend, a device spec and a feature plan.

This runs once at the entry point; everything below it receives typed objects.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from corelib.backend import Backend, DeviceSpec, resolve_runtime
from corelib.compose import load_group_option
from corelib.config import BackendConfig, CorelibConfig
from corelib.errors import ConfigError, PluginError
from corelib.features import Plan, evaluate
from corelib.models import model_facts
from corelib.models.hf_config import resolve_checkpoint
from corelib.plugins import PluginRegistry


@dataclass(frozen=True)
class Startup:
    """The decisions made before anything runs, and the lines that explain them."""

    raw: DictConfig
    config: CorelibConfig
    backend: Backend
    spec: DeviceSpec
    plan: Plan
    messages: tuple[str, ...]


def start(raw: DictConfig, registry: PluginRegistry) -> Startup:
    """Choose the backend and runtime, then evaluate every feature gate."""
    raw = raw.copy()
    messages: list[str] = resolve_checkpoint(raw)  # model.path: config.json's values replace the preset's
    name = str(raw.backend.name)
    if name == "auto":
        name, why = _choose_auto(raw, registry)
        chosen = load_group_option("backend", name)
        OmegaConf.set_struct(raw, False)
        raw.backend = chosen
        OmegaConf.set_struct(raw, True)
        messages.append(f"backend=auto chose {name}: {why}")
    _check_allowed(raw, registry, name)
    backend = registry.get(name)
    config = _typed(raw)
    resolution = resolve_runtime(backend, config.backend, config.engine.timeout_s)
    messages.append(resolution.message)
    plan = evaluate(config.features, raw, resolution.spec.capabilities.as_dict(), model_facts(config.model))
    return Startup(raw, config, backend, resolution.spec, plan, tuple(messages))


def _typed(raw: DictConfig) -> CorelibConfig:
    config = OmegaConf.to_object(raw)
    if not isinstance(config, CorelibConfig):
        raise ConfigError("the composed config does not follow the corelib schema (corelib_schema missing)")
    return config


def _check_allowed(raw: DictConfig, registry: PluginRegistry, name: str) -> None:
    if not registry.has(name):
        return
    plugin = registry.plugin_of(name)
    allow = raw.plugins.allow
    if plugin in raw.plugins.block or (allow is not None and plugin not in allow):
        raise PluginError(f"backend {name!r} comes from plugin {plugin!r}, which plugins.allow/block excludes")


def _choose_auto(raw: DictConfig, registry: PluginRegistry) -> tuple[str, str]:
    auto: BackendConfig = raw.backend
    refusals: list[str] = []
    for candidate in auto.candidates:
        if not registry.has(candidate):
            refusals.append(f"{candidate}: no plugin installed")
            continue
        availability = registry.get(candidate).probe()
        if availability.native:
            return candidate, f"it runs natively ({availability.reason})"
        refusals.append(f"{candidate}: {availability.reason}")
    if not auto.fallback:
        raise ConfigError(f"backend=auto found no native backend ({'; '.join(refusals)}) and has no fallback")
    return auto.fallback, f"no candidate runs natively here ({'; '.join(refusals)})"
