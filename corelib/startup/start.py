"""From a composed config to a chosen backend, a device spec and a feature plan.

This runs once at the entry point; everything below it receives typed objects.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from corelib.config.features import Plan, evaluate
from corelib.config.schema import BackendConfig, CorelibConfig
from corelib.errors import ConfigError, PluginError
from corelib.models import model_facts
from corelib.models.hf_config import resolve_checkpoint
from corelib.ops import OP_NAMES
from corelib.platform.backend import Backend, DeviceSpec, resolve_runtime
from corelib.platform.device import Runtime
from corelib.plugins import PluginRegistry
from corelib.startup.compose import check_schema_keys, check_targets, load_group_option, translate_error
from corelib.startup.limits import check_limits, check_memory

if TYPE_CHECKING:
    from corelib.config.options import EngineOptions

log = logging.getLogger("corelib.startup")


@dataclass(frozen=True)
class Startup:
    """The decisions made before anything runs, and the lines that explain them."""

    raw: DictConfig
    config: CorelibConfig
    backend: Backend
    spec: DeviceSpec
    plan: Plan
    messages: tuple[str, ...]
    options: EngineOptions  # the plan, as the engine uses it
    # model.max_model_len is the model's own limit (it was left at 0), so the KV sizing may cut it to the pool
    default_context: bool = False


def start(raw: DictConfig, registry: PluginRegistry) -> Startup:
    """Check the config, choose the backend and runtime, then evaluate every feature gate."""
    try:
        return _start(raw, registry)
    except OmegaConfBaseException as error:
        raise translate_error(error) from None


def _start(raw: DictConfig, registry: PluginRegistry) -> Startup:
    check_targets(raw, registry.trusted_packages)
    check_schema_keys(raw)
    raw = raw.copy()
    messages: list[str] = []
    name = str(raw.backend.name)
    if name == "auto":
        name, why = _choose_auto(raw, registry)
        chosen = _with_user_changes(load_group_option("backend", name), raw.backend)
        with open_dict(raw):
            raw.backend = chosen
        messages.append(f"backend=auto chose {name}: {why}")
    # model.path: config.json's values replace the preset's; dtype=auto depends on whether the device is the host
    # (a fact of the backend's profile, which no probe changes)
    host = bool(raw.backend.get("capabilities", {}).get("device_is_host", False))
    default_context = not int(raw.model.get("max_model_len") or 0)
    messages[:0] = resolve_checkpoint(raw, host)
    backend = registry.get(name)
    _check_allowed(raw, registry, name)
    config = _typed(raw)
    check_limits(config)
    check_sampling_defaults(config.model.sampling_defaults)
    resolution = resolve_runtime(backend, config.backend, config.engine.timeout_s)
    check_memory(config, resolution.spec, default_context)
    messages.append(resolution.message)
    facts = model_facts(config.model)
    plan = evaluate(config.features, raw, resolution.spec.capabilities.as_dict(), facts)
    from corelib.config.options import EngineOptions  # the engine package imports this module

    provider = backend.op_provider()
    options = EngineOptions.from_startup(config, plan, resolution.spec.capabilities, provider, facts,
                                         emulated=resolution.spec.runtime is Runtime.emulated)
    if options.fused_ops and provider is not None:
        rest = [op for op in OP_NAMES if op not in options.fused_ops]
        messages.append(f"fused ops from {provider.name}: {', '.join(options.fused_ops)}"
                        + (f"; the reference runs {', '.join(rest)}" if rest else "")
                        + ("; the norms' weights folded into the qkv and gate/up weights where the layers run fused"
                           if options.fold_norms else ""))
    return Startup(raw, config, backend, resolution.spec, plan, tuple(messages), options, default_context)


def check_sampling_defaults(defaults: Mapping[str, Any]) -> None:
    """Refuse, naming the key, a sampling default that is not a request field of generation_config.json's set,
    or a value every request that leaves it out would be refused for."""
    from corelib.models.hf_config import GENERATION_DEFAULTS
    from corelib.sampling_params import SamplingError, SamplingParams

    allowed = sorted(GENERATION_DEFAULTS.values())
    for name in defaults:
        if name not in allowed:
            raise ConfigError(f"model.sampling_defaults.{name}: not a sampling default; allowed: {', '.join(allowed)}")
    try:
        SamplingParams(**dict(defaults))
    except (SamplingError, TypeError) as error:
        field = getattr(error, "field", "")
        raise ConfigError(f"model.sampling_defaults.{field}: {error} (from model.sampling_defaults, or the "
                          "checkpoint's generation_config.json)") from None


def _typed(raw: DictConfig) -> CorelibConfig:
    try:
        config = OmegaConf.to_object(raw)
    except OmegaConfBaseException as error:
        raise translate_error(error) from None
    if not isinstance(config, CorelibConfig):
        raise ConfigError(
            "the composed config does not follow the corelib schema; keep corelib_schema in its defaults"
        )
    return config


def _check_allowed(raw: DictConfig, registry: PluginRegistry, name: str) -> None:
    plugin = registry.plugin_of(name)
    allow = raw.plugins.allow
    if plugin in raw.plugins.block or (allow is not None and plugin not in allow):
        raise PluginError(
            f"backend {name!r} comes from plugin {plugin!r}, which plugins.allow/block excludes; "
            "change those keys or choose another backend"
        )


def _choose_auto(raw: DictConfig, registry: PluginRegistry) -> tuple[str, str]:
    auto: BackendConfig = raw.backend
    refusals: list[str] = []
    names: list[str] = []
    for candidate in auto.candidates:
        if not registry.has(candidate):
            refusals.append(f"{candidate}: {_not_selectable(registry, candidate)}")
            names.append(candidate)
            continue
        availability = registry.get(candidate).probe()
        if availability.native:
            return candidate, f"it runs natively ({availability.reason})"
        refusals.append(f"{candidate}: {availability.reason}")
        names.append(candidate)
    if not auto.fallback:
        raise ConfigError(
            f"backend=auto found no native backend ({'; '.join(refusals)}) and backend.fallback is empty; "
            "choose a backend"
        )
    log.info("backend=auto: %s", "; ".join(refusals))  # the long reasons go to run.log; the console gets one line
    listed = ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)
    return auto.fallback, f"no {listed} device here (python -m corelib backends says why)"


def _not_selectable(registry: PluginRegistry, name: str) -> str:
    """Why ``name`` cannot be selected, short enough for the one line backend=auto prints."""
    if name in registry.conflicts:
        return f"claimed by plugins {' and '.join(registry.conflicts[name])}"
    record = registry.records.get(name)
    if record is not None:
        return f"plugin {record.status} ({record.error})"
    return "no plugin installed"


def _with_user_changes(chosen: DictConfig, auto: DictConfig) -> DictConfig:
    """Carry what the user set on ``backend=auto`` (say backend.device_index=1) to the chosen one."""
    defaults = OmegaConf.to_container(OmegaConf.structured(BackendConfig), enum_to_str=True)
    user = OmegaConf.to_container(auto, resolve=True, enum_to_str=True)
    if not isinstance(defaults, dict) or not isinstance(user, dict):
        raise TypeError("a backend config must be a mapping")
    changes = _changed(user, defaults, skip=("name", "candidates", "fallback"))
    if not changes:
        return chosen
    merged = chosen.copy()
    # Capabilities added with +backend.capabilities.x are checked when the backend resolves.
    with open_dict(merged):
        merged.merge_with(changes)
    return merged


def _changed(user: dict[Any, Any], defaults: dict[Any, Any], skip: tuple[str, ...] = ()) -> dict[Any, Any]:
    changes: dict[Any, Any] = {}
    for key, value in user.items():
        if key in skip:
            continue
        default = defaults.get(key)
        if isinstance(value, dict) and isinstance(default, dict):
            nested = _changed(value, default)
            if nested:
                changes[key] = nested
        elif value != default:
            changes[key] = value
    return changes
