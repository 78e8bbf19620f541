"""Feature gates: every gate under auto, on and off, with every requirement made to fail once.

The requirements are read from the shipped ``conf/features/*.yaml``, so a requirement added
there is tested here without editing this file.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf

from corelib.config.features import Plan, evaluate
from corelib.config.schema import CorelibConfig, Mode
from corelib.errors import ConfigError, PlanRefused
from corelib.models import model_facts
from corelib.startup.compose import compose_config

# Where every start requirement of every shipped gate holds: the npu profile, SHM transport, two
# tensor-parallel ranks, and (below) symmetric memory and programmatic launch, which the npu
# profile lacks.
BASE_OVERRIDES = ["backend=npu", "engine.transport=shm", "engine.tp=2"]
BASE_CAPABILITIES = {"symmetric_memory": True, "programmatic_launch": True, "programmatic_launch_kernels": True}


@dataclass
class Scenario:
    """A config plus the capability and model facts the gates are evaluated against."""

    overrides: list[str] = field(default_factory=lambda: list(BASE_OVERRIDES))
    capabilities: dict[str, Any] = field(default_factory=lambda: dict(BASE_CAPABILITIES))
    model: dict[str, Any] = field(default_factory=dict)

    def evaluate(self) -> Plan:
        cfg = _compose(tuple(self.overrides))
        typed = OmegaConf.to_object(cfg)
        assert isinstance(typed, CorelibConfig), "the composed config must follow the schema"
        capabilities = {**OmegaConf.to_container(cfg.backend.capabilities), **self.capabilities}  # type: ignore[dict-item]
        facts = {**model_facts(typed.model), **self.model}
        return evaluate(cfg.features, cfg, capabilities, facts)


# Gates that complement another, whose requirements cannot all hold in the one scenario above: each in a scenario
# of its own where they do. shm_overlap runs the scheduler ahead over SHM where the device is the host, which is
# where async token handoff (and ordered materialization) cannot be on. structured_overlap runs in process, where
# ordered materialization (over SHM) is off.
ALONE: dict[str, tuple[list[str], dict[str, Any]]] = {
    "shm_overlap": (["engine.async_token_handoff=off"], {"device_is_host": True}),
    "structured_overlap": (["engine.transport=inproc"], {}),
}


def scenario_for(gate: str) -> Scenario:
    """The scenario where every start requirement of ``gate`` holds."""
    overrides, capabilities = ALONE.get(gate, ([], {}))
    return Scenario([*BASE_OVERRIDES, *overrides], {**BASE_CAPABILITIES, **capabilities})


@functools.cache
def _compose(overrides: tuple[str, ...]) -> DictConfig:
    """Compose once per distinct override list; evaluate() only reads the config."""
    return compose_config(overrides)


@pytest.fixture(scope="module")
def gates() -> DictConfig:
    features = compose_config(BASE_OVERRIDES).features
    assert isinstance(features, DictConfig), "features must compose to a mapping"
    return features


def _mode_value(gate: DictConfig, mode: Mode) -> str:
    """The value to write at the gate's mode key to mean ``mode`` (ordered is on, for example)."""
    for written, meant in dict(gate.mode_map).items():
        if meant == mode.value:
            return str(written)
    return mode.value


def _mode_override(name: str, gate: DictConfig, mode: Mode) -> str:
    key = gate.mode_key or f"features.{name}.mode"
    return f"{key}={_mode_value(gate, mode)}"


def _break(scenario: Scenario, fact: str, value: Any, gates: DictConfig, op: str = "eq") -> None:
    """Change the scenario so that ``fact op value`` no longer holds."""
    namespace, _, rest = fact.partition(".")
    if op != "eq":
        assert namespace == "config", f"no way to make {fact} {op} {value} fail yet: extend _break"
        scenario.overrides.append(f"{rest}={_config_value_failing(rest, op, value)}")
        return
    if namespace == "capabilities":
        scenario.capabilities[rest] = not value if isinstance(value, bool) else f"not-{value}"
    elif namespace == "model":
        scenario.model[rest] = not value if isinstance(value, bool) else f"not-{value}"
    elif namespace == "features":  # the other gate switched off, or on where it must be off
        scenario.overrides.append(_mode_override(rest, gates[rest], Mode.on if value is False else Mode.off))
    elif namespace == "config":
        scenario.overrides.append(f"{rest}={_other_config_value(rest, value)}")
    else:
        raise AssertionError(f"no way to make {fact} fail yet: extend _break")


def _other_config_value(key: str, value: Any) -> str:
    if value is None:
        return "something"
    if isinstance(value, bool):
        return str(not value).lower()
    if key == "engine.transport":  # an enum: the other member
        return "inproc" if value == "shm" else "shm"
    return f"not-{value}"


def _config_value_failing(key: str, op: str, value: Any) -> str:
    if op == "ge":
        return str(value - 1)
    if op == "in" and key == "model.dtype":
        return next(d for d in ("float16", "float64") if d not in value)
    raise AssertionError(f"no way to make {key} {op} {value} fail yet: extend _config_value_failing")


def _start_requirements(gates: DictConfig) -> list[tuple[str, int]]:
    return [
        (str(name), index)
        for name, gate in gates.items()
        for index, requirement in enumerate(gate.requirements)
        if requirement.scope.value == "start"
    ]


def _ids(cases: list[tuple[str, int]], gates: DictConfig) -> list[str]:
    return [f"{name}:{gates[name].requirements[index].fact}" for name, index in cases]


GATES = compose_config(BASE_OVERRIDES).features
START_CASES = _start_requirements(GATES)


def test_the_gates_of_the_design_exist_with_their_requirements(gates: DictConfig) -> None:
    facts = {name: {r.fact for r in gate.requirements} for name, gate in gates.items()}
    assert {"capabilities.graphs", "capabilities.streams"} <= facts["graph"]
    assert {
        "capabilities.streams",
        "capabilities.events",
        "capabilities.async_d2h",
        "capabilities.pinned_host",
        "features.graph",
        "config.engine.kv_cache",
        "model.device_decode_inputs",
        "config.engine.speculative_draft_model",
        "config.engine.kv_transfer_connector",
        "model.recurrent_state",
        "request.multimodal",
    } <= facts["async_token_handoff"]
    assert {
        "config.engine.transport",
        "features.graph",
        "features.async_token_handoff",
        "capabilities.pageable_h2d_is_staged",
    } <= facts["shm_ordered_materialization"]
    assert {
        "config.engine.tp",
        "capabilities.symmetric_memory",
        "config.model.dtype",
        "features.graph",
    } <= facts["fast_allreduce"]


def test_every_gate_is_enabled_under_auto_when_every_requirement_holds() -> None:
    plan = Scenario().evaluate()
    for name in plan.decisions:
        decision = scenario_for(name).evaluate().decisions[name]
        assert decision.enabled, f"{name}: {decision.reasons}"
        assert decision.mode is Mode.auto


@pytest.mark.parametrize(("gate", "index"), START_CASES, ids=_ids(START_CASES, GATES))
def test_auto_disables_and_lists_the_reason_of_each_failed_requirement(
    gates: DictConfig, gate: str, index: int
) -> None:
    requirement = gates[gate].requirements[index]
    scenario = scenario_for(gate)
    _break(scenario, requirement.fact, requirement.value, gates, requirement.op.value)
    decision = scenario.evaluate().decisions[gate]
    assert not decision.enabled
    assert requirement.reason in decision.reasons


@pytest.mark.parametrize(("gate", "index"), START_CASES, ids=_ids(START_CASES, GATES))
def test_on_refuses_each_failed_requirement_unless_it_only_matters_to_auto(
    gates: DictConfig, gate: str, index: int
) -> None:
    requirement = gates[gate].requirements[index]
    scenario = scenario_for(gate)
    _break(scenario, requirement.fact, requirement.value, gates, requirement.op.value)
    scenario.overrides.append(_mode_override(gate, gates[gate], Mode.on))
    if requirement.auto_only:
        decision = scenario.evaluate().decisions[gate]
        assert decision.enabled
        assert any(requirement.reason in reason for reason in decision.reasons)
        return
    with pytest.raises(PlanRefused) as refused:
        scenario.evaluate()
    setting = _mode_override(gate, gates[gate], Mode.on)
    assert (setting, requirement.reason) in refused.value.unmet
    assert f"{setting} refused: {requirement.reason}" in str(refused.value).splitlines()


@pytest.mark.parametrize("gate", list(GATES))
def test_on_lists_every_unmet_requirement_at_once(gates: DictConfig, gate: str) -> None:
    scenario = scenario_for(gate)
    required = [r for r in gates[gate].requirements if r.scope.value == "start" and not r.auto_only]
    for requirement in required:
        if not requirement.fact.startswith("features."):  # a dependency has its own gate
            _break(scenario, requirement.fact, requirement.value, gates, requirement.op.value)
    scenario.overrides.append(_mode_override(gate, gates[gate], Mode.on))
    with pytest.raises(PlanRefused) as refused:
        scenario.evaluate()
    setting = _mode_override(gate, gates[gate], Mode.on)
    listed = [reason for where, reason in refused.value.unmet if where == setting]
    expected = [r.reason for r in required if not r.fact.startswith("features.")]
    assert set(expected) <= set(listed)
    assert len(str(refused.value).splitlines()) == len(refused.value.unmet)


@pytest.mark.parametrize("gate", list(GATES))
def test_on_enables_a_gate_whose_requirements_hold(gates: DictConfig, gate: str) -> None:
    scenario = scenario_for(gate)
    scenario.overrides.append(_mode_override(gate, gates[gate], Mode.on))
    decision = scenario.evaluate().decisions[gate]
    assert decision.enabled
    assert decision.mode is Mode.on


@pytest.mark.parametrize("gate", list(GATES))
def test_off_disables_a_gate_whose_requirements_hold_and_says_so(gates: DictConfig, gate: str) -> None:
    scenario = scenario_for(gate)
    setting = _mode_override(gate, gates[gate], Mode.off)
    scenario.overrides.append(setting)
    decision = scenario.evaluate().decisions[gate]
    assert not decision.enabled
    assert decision.reasons == (f"switched off by {setting}",)


def test_a_gate_that_depends_on_a_disabled_gate_names_it() -> None:
    scenario = Scenario(overrides=[*BASE_OVERRIDES, "engine.graph=off", "engine.async_token_handoff=on"])
    with pytest.raises(PlanRefused, match=r"engine.async_token_handoff=on refused: graphs are disabled"):
        scenario.evaluate()


def test_on_refusals_of_several_gates_are_all_listed() -> None:
    scenario = Scenario(overrides=["backend=cpu", "engine.graph=on", "engine.async_token_handoff=on"])
    with pytest.raises(PlanRefused) as refused:
        scenario.evaluate()
    settings = {where for where, _ in refused.value.unmet}
    assert settings == {"engine.graph=on", "engine.async_token_handoff=on"}


STEP_CASES = [
    (name, index)
    for name, gate in GATES.items()
    for index, requirement in enumerate(gate.requirements)
    if requirement.scope.value == "step"
]


@pytest.mark.parametrize(("gate", "index"), STEP_CASES, ids=_ids(STEP_CASES, GATES))
def test_a_step_requirement_blocks_only_the_steps_that_fail_it(
    gates: DictConfig, gate: str, index: int
) -> None:
    plan = scenario_for(gate).evaluate()
    requirements = gates[gate].requirements
    fine = {r.fact.partition(".")[2]: r.value for r in requirements if r.scope.value == "step"}
    failing = dict(fine)
    failing[requirements[index].fact.partition(".")[2]] = not requirements[index].value
    assert plan.step_blockers(gate, [fine, fine]) == []
    assert plan.step_blockers(gate, [fine, failing]) == [requirements[index].reason]


# -- gates written as YAML only ---------------------------------------------------------------

NEW_GATE = """\
# A gate added without any Python: its mode lives in the gate itself.
fast_sampling:
  mode: auto  # auto, on or off
  description: sample on the device when it can time its events
  requirements:
    - fact: capabilities.event_timing
      reason: the device cannot time its events
    - fact: config.workload.temperature
      op: le
      value: 1.0
      reason: the temperature is above 1 (workload.temperature)
    - fact: model.architecture
      op: in
      value: [llama, qwen2]
      reason: the architecture is not llama or qwen2
    - fact: features.graph
      reason: graphs are off
"""


@pytest.fixture
def extra_gate_dir(tmp_path: Path) -> Path:
    (tmp_path / "features").mkdir()
    (tmp_path / "features" / "fast_sampling.yaml").write_text(NEW_GATE)
    return tmp_path


def _with_new_gate(extra_gate_dir: Path, *overrides: str) -> list[str]:
    return [
        *BASE_OVERRIDES,
        f"hydra.searchpath=[file://{extra_gate_dir}]",
        "features=[graph,async_token_handoff,shm_ordered_materialization,fast_sampling]",
        *overrides,
    ]


def test_a_gate_added_as_yaml_only_is_evaluated(extra_gate_dir: Path) -> None:
    plan = Scenario(overrides=_with_new_gate(extra_gate_dir)).evaluate()
    assert plan.is_enabled("fast_sampling")
    plan = Scenario(overrides=_with_new_gate(extra_gate_dir, "workload.temperature=1.5")).evaluate()
    assert plan.decisions["fast_sampling"].reasons == ("the temperature is above 1 (workload.temperature)",)


def test_a_gate_added_as_yaml_only_is_switched_at_its_own_mode_key(extra_gate_dir: Path) -> None:
    scenario = Scenario(
        overrides=_with_new_gate(extra_gate_dir, "features.fast_sampling.mode=on", "engine.graph=off"),
        model={"architecture": "qwen3"},
    )
    with pytest.raises(PlanRefused) as refused:
        scenario.evaluate()
    assert refused.value.unmet == [
        ("features.fast_sampling.mode=on", "the architecture is not llama or qwen2"),
        ("features.fast_sampling.mode=on", "graphs are off"),
    ]


# -- mistakes in gate files -------------------------------------------------------------------


def _evaluate_gates(gates: dict[str, Any], *overrides: str) -> Plan:
    cfg = _compose((*BASE_OVERRIDES, *overrides))
    features = OmegaConf.merge(OmegaConf.structured(CorelibConfig).features, gates)
    capabilities = OmegaConf.to_container(cfg.backend.capabilities)
    return evaluate(features, cfg, capabilities, {"architecture": "llama"})  # type: ignore[arg-type]


def _gate(*requirements: dict[str, Any], mode: str = "auto") -> dict[str, Any]:
    return {"mode": mode, "requirements": list(requirements)}


def test_an_unknown_fact_is_an_error_even_when_the_gate_is_off() -> None:
    gates = {"g": _gate({"fact": "capabilities.graph", "reason": "r"}, mode="off")}
    with pytest.raises(
        ConfigError, match=r"feature 'g'.*unknown fact 'capabilities.graph' \(did you mean 'graphs'\?\)"
    ):
        _evaluate_gates(gates)


def test_gates_that_depend_on_each_other_in_a_cycle_are_an_error() -> None:
    gates = {
        "a": _gate({"fact": "features.b", "reason": "b is off"}),
        "b": _gate({"fact": "features.a", "reason": "a is off"}),
    }
    with pytest.raises(ConfigError, match=r"cycle: a -> b -> a"):
        _evaluate_gates(gates)


def test_a_dependency_on_an_unknown_gate_is_an_error() -> None:
    gates = {"a": _gate({"fact": "features.nope", "reason": "r"})}
    with pytest.raises(ConfigError, match=r"feature 'a' depends on unknown feature 'nope'"):
        _evaluate_gates(gates)


@pytest.mark.parametrize(
    ("gate", "message"),
    [
        ({"requirements": []}, "sets neither mode_key nor mode"),
        ({"mode": "on", "mode_key": "engine.graph", "requirements": []}, "not both"),
        ({"mode_key": "engine.nope", "requirements": []}, "mode_key 'engine.nope' is not a config key"),
        (_gate({"fact": "request.multimodal", "reason": "r"}), "add scope: step"),
        (
            _gate({"fact": "capabilities.graphs", "scope": "step", "reason": "r"}),
            "must name a request.* fact",
        ),
        (
            _gate({"fact": "model.architecture", "op": "in", "value": "llama", "reason": "r"}),
            "needs a list value",
        ),
        (_gate({"fact": "model.architecture", "op": "ge", "value": 3, "reason": "r"}), "cannot compare"),
    ],
)
def test_a_malformed_gate_is_a_one_line_error(gate: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        _evaluate_gates({"g": gate})
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)
