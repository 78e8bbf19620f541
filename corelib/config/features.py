"""Feature gates as data: evaluate ``conf/features/*.yaml`` into a Plan.

A requirement is a comparison over one fact. Facts come from four namespaces:
``capabilities.*`` (the opened backend), ``config.*`` (the resolved config), ``model.*``
(what the model declares) and ``features.*`` (earlier decisions, true when enabled).
Step-scoped requirements use ``request.*`` and are checked per scheduled batch.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from corelib.config.schema import FeatureConfig, Mode, Op, RequirementConfig, Scope
from corelib.errors import ConfigError, PlanRefused

_MISSING = object()


@dataclass(frozen=True)
class Requirement:
    """One condition of a gate, read from its YAML."""

    feature: str
    fact: str
    op: Op
    value: Any
    reason: str
    scope: Scope
    auto_only: bool

    @classmethod
    def from_config(cls, feature: str, cfg: RequirementConfig) -> Requirement:
        requirement = cls(
            feature, cfg.fact, Op(cfg.op), _plain(cfg.value), cfg.reason, Scope(cfg.scope), cfg.auto_only
        )
        requirement._check_shape()
        return requirement

    def _check_shape(self) -> None:
        where = f"feature {self.feature!r}, requirement on {self.fact!r}"
        is_request_fact = self.fact.startswith("request.")
        if self.scope is Scope.step and not is_request_fact:
            raise ConfigError(f"{where}: a scope: step requirement must name a request.* fact")
        if self.scope is Scope.start and is_request_fact:
            raise ConfigError(f"{where}: request.* facts exist only per step; add scope: step")
        if self.op in (Op["in"], Op.not_in) and not isinstance(self.value, list):
            raise ConfigError(f"{where}: op {self.op.value} needs a list value, got {self.value!r}")

    def check_fact(self, facts: Mapping[str, Any]) -> None:
        """Fail if the fact does not exist, so a misspelled gate is caught whatever its mode."""
        if self.scope is Scope.start and _lookup(facts, self.fact) is _MISSING:
            raise self._unknown_fact(facts)

    def _unknown_fact(self, facts: Mapping[str, Any]) -> ConfigError:
        hint = _hint(facts, self.fact)
        return ConfigError(f"feature {self.feature!r}: requirement names unknown fact {self.fact!r}{hint}")

    def holds(self, facts: Mapping[str, Any]) -> bool:
        actual = _lookup(facts, self.fact)
        if actual is _MISSING:
            raise self._unknown_fact(facts)
        try:
            return _compare(self.op, _plain(actual), self.value)
        except TypeError:
            comparison = f"{self.fact} ({actual!r}) {self.op.value} {self.value!r}"
            raise ConfigError(f"feature {self.feature!r}: cannot compare {comparison}") from None


@dataclass(frozen=True)
class Decision:
    """Whether one feature is enabled, and the reasons."""

    feature: str
    mode_key: str
    mode_value: str
    mode: Mode
    enabled: bool
    reasons: tuple[str, ...]
    step_requirements: tuple[Requirement, ...] = ()
    combines: tuple[tuple[str, str], ...] = ()  # (other feature, what holds when both are on)

    def as_dict(self) -> dict[str, Any]:
        return {
            "feature": self.feature,
            "mode_key": self.mode_key,
            "mode": self.mode_value,
            "enabled": self.enabled,
            "reasons": list(self.reasons),
            "per_step": [r.reason for r in self.step_requirements],
            "combines": {other: rule for other, rule in self.combines},
        }


@dataclass(frozen=True)
class Plan:
    """Every feature's decision, in evaluation order."""

    decisions: Mapping[str, Decision] = field(default_factory=dict)

    def is_enabled(self, feature: str) -> bool:
        decision = self.decisions.get(feature)
        return decision is not None and decision.enabled

    def step_blockers(self, feature: str, request_facts: Sequence[Mapping[str, Any]]) -> list[str]:
        """Reasons the per-step requirements of ``feature`` fail for a batch (empty: none fail)."""
        decision = self.decisions.get(feature)
        if decision is None or not decision.enabled:
            return []
        return failing_step_requirements(decision.step_requirements, request_facts)

    def as_dict(self) -> dict[str, Any]:
        return {name: d.as_dict() for name, d in self.decisions.items()}


def failing_step_requirements(
    requirements: Sequence[Requirement], request_facts: Sequence[Mapping[str, Any]]
) -> list[str]:
    """The reasons of the per-step requirements that some request of a batch fails."""
    return [r.reason for r in requirements if not all(r.holds({"request": facts}) for facts in request_facts)]


def evaluate(
    features: Mapping[str, FeatureConfig] | DictConfig,
    config: DictConfig,
    capabilities: Mapping[str, Any],
    model_facts: Mapping[str, Any],
) -> Plan:
    """Decide every feature. Raises PlanRefused listing every unmet requirement of every `on`."""
    specs: dict[str, FeatureConfig] = {name: spec for name, spec in features.items()}  # type: ignore[misc]
    resolved = OmegaConf.to_container(config, resolve=True, enum_to_str=True)
    facts: dict[str, Any] = {
        "capabilities": dict(capabilities),
        "config": resolved,
        "model": dict(model_facts),
        "features": {},
    }
    decisions: dict[str, Decision] = {}
    refusals: list[tuple[str, list[str]]] = []
    for name in _dependency_order(specs):
        decision, unmet = _decide(name, specs[name], config, facts)
        if unmet:
            refusals.append((f"{decision.mode_key}={decision.mode_value}", unmet))
        decisions[name] = decision
        facts["features"][name] = decision.enabled
    if refusals:
        raise PlanRefused([(setting, reason) for setting, unmet in refusals for reason in unmet])
    return Plan(decisions)


def _mode_of(name: str, spec: FeatureConfig, config: DictConfig) -> tuple[str, str, Mode]:
    """The key the mode is set at, its value as the user wrote it, and the mode it means."""
    if spec.mode_key and spec.mode is not None:
        raise ConfigError(f"feature {name!r}: set mode_key or mode in features/{name}.yaml, not both")
    if spec.mode_key:
        mode_key = spec.mode_key
        raw = OmegaConf.select(config, mode_key, default=_MISSING)
        if raw is _MISSING:
            raise ConfigError(
                f"feature {name!r}: mode_key {mode_key!r} is not a config key; fix features/{name}.yaml"
            )
    elif spec.mode is not None:
        mode_key, raw = f"features.{name}.mode", spec.mode
    else:
        raise ConfigError(f"feature {name!r}: features/{name}.yaml sets neither mode_key nor mode")
    mode_value = str(_plain(raw)).lower()
    mode_map = dict(spec.mode_map)
    try:
        mode = Mode(mode_map.get(mode_value, mode_value))
    except ValueError:
        raise ConfigError(
            f"{mode_key}={mode_value}: expected one of {', '.join(mode_map or [m.value for m in Mode])}"
        ) from None
    return mode_key, mode_value, mode


def _decide(
    name: str, spec: FeatureConfig, config: DictConfig, facts: Mapping[str, Any]
) -> tuple[Decision, list[str]]:
    mode_key, mode_value, mode = _mode_of(name, spec, config)
    requirements = [Requirement.from_config(name, r) for r in spec.requirements]
    for requirement in requirements:
        requirement.check_fact(facts)
    at_start = [r for r in requirements if r.scope is Scope.start]
    per_step = tuple(r for r in requirements if r.scope is Scope.step)
    combines = tuple((c.feature, c.rule) for c in spec.combines)

    def decision(enabled: bool, reasons: list[str]) -> Decision:
        return Decision(name, mode_key, mode_value, mode, enabled, tuple(reasons), per_step, combines)

    if mode is Mode.off:
        return decision(False, [f"switched off by {mode_key}={mode_value}"]), []
    failed = [r for r in at_start if not r.holds(facts)]
    if mode is Mode.on:
        unmet = [r.reason for r in failed if not r.auto_only]
        if unmet:
            return decision(False, unmet), unmet
        notes = [f"forced by {mode_key}={mode_value}"]
        notes += [f"{r.reason} (not required when forced)" for r in failed]
        return decision(True, notes), []
    if failed:
        return decision(False, [r.reason for r in failed]), []
    return decision(True, [f"all {len(at_start)} requirements hold"]), []


def _dependency_order(specs: Mapping[str, FeatureConfig]) -> list[str]:
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise ConfigError(f"feature gates depend on each other in a cycle: {' -> '.join([*path, name])}")
        state[name] = "visiting"
        for requirement in specs[name].requirements:
            head, _, dep = requirement.fact.partition(".")
            if head == "features":
                if dep not in specs:
                    raise ConfigError(f"feature {name!r} depends on unknown feature {dep!r}")
                visit(dep, [*path, name])
        state[name] = "done"
        order.append(name)

    for name in specs:
        visit(name, [])
        unknown = [c.feature for c in specs[name].combines if c.feature not in specs]
        if unknown:
            raise ConfigError(f"feature {name!r} states how it combines with unknown feature {unknown[0]!r}")
    return order


def _hint(facts: Mapping[str, Any], dotted: str) -> str:
    """Name the closest existing key at the level where ``dotted`` stops resolving."""
    node: Any = facts
    for part in dotted.split("."):
        if not isinstance(node, Mapping):
            return ""
        if part not in node:
            close = difflib.get_close_matches(part, [str(k) for k in node], n=1)
            if close:
                return f" (did you mean {close[0]!r}?)"
            return f" (known here: {', '.join(sorted(map(str, node)))})"
        node = node[part]
    return ""


def _lookup(facts: Mapping[str, Any], dotted: str) -> Any:
    node: Any = facts
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _plain(value: Any) -> Any:
    if value is None or type(value) in (bool, int, float, str):
        return value  # the per-step facts: checked for every batch, so the common case costs nothing
    if isinstance(value, enum.Enum):
        return value.value
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True, enum_to_str=True)
    return value


def _compare(op: Op, actual: Any, expected: Any) -> bool:
    if op is Op.eq:
        return bool(actual == expected)
    if op is Op.ne:
        return bool(actual != expected)
    if op is Op["in"]:
        return actual in expected
    if op is Op.not_in:
        return actual not in expected
    if op is Op.ge:
        return bool(actual >= expected)
    if op is Op.le:
        return bool(actual <= expected)
    raise ConfigError(f"unknown requirement operator {op!r}")
