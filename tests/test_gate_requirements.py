"""Each shipped gate's requirements, written out by hand, and what each one does to the plan.

tests/test_features.py derives its cases from the YAML it tests, so a requirement deleted from
``conf/features/`` takes its own test with it. Here the lists are literal: deleting, loosening
or re-scoping any requirement of these gates fails a test, and so does a requirement that
stops changing the plan when its fact fails. Gates not listed here (added later as YAML) are
left alone.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf

from corelib.config.features import Decision, Plan, evaluate
from corelib.config.schema import CorelibConfig
from corelib.errors import PlanRefused
from corelib.models import model_facts
from corelib.startup.compose import compose_config

# (fact, op, value, scope, auto_only)
Requirement = tuple[str, str, Any, str, bool]

EXPECTED: dict[str, set[Requirement]] = {
    "graph": {
        ("capabilities.graphs", "eq", True, "start", False),
        ("capabilities.streams", "eq", True, "start", False),
    },
    "async_token_handoff": {
        ("capabilities.streams", "eq", True, "start", False),
        ("capabilities.events", "eq", True, "start", False),
        ("capabilities.event_query", "eq", True, "start", False),
        ("capabilities.async_d2h", "eq", True, "start", False),
        ("capabilities.pinned_host", "eq", True, "start", False),
        ("features.graph", "eq", True, "start", False),
        ("config.engine.kv_cache", "eq", "paged", "start", False),
        ("model.device_decode_inputs", "eq", True, "start", False),
        ("config.engine.speculative_draft_model", "eq", None, "start", False),
        ("config.engine.kv_transfer_connector", "eq", None, "start", False),
        ("model.recurrent_state", "eq", False, "start", False),
        ("request.multimodal", "eq", False, "step", False),
        ("request.host_stop_strings", "eq", False, "step", False),
        ("request.structured_output", "eq", False, "step", False),
    },
    "shm_ordered_materialization": {
        ("config.engine.transport", "eq", "shm", "start", False),
        ("capabilities.device_is_host", "eq", False, "start", False),
        ("features.graph", "eq", True, "start", True),
        ("features.async_token_handoff", "eq", True, "start", True),
        ("capabilities.pageable_h2d_is_staged", "eq", False, "start", True),
    },
    "fast_allreduce": {
        ("config.engine.tp", "ge", 2, "start", False),
        ("capabilities.symmetric_memory", "eq", True, "start", False),
        ("config.model.dtype", "in", ("bfloat16", "float32", "auto"), "start", False),
        ("features.graph", "eq", True, "start", True),
    },
    "pdl": {
        ("capabilities.programmatic_launch", "eq", True, "start", False),
        ("capabilities.programmatic_launch_kernels", "eq", True, "start", False),
        ("features.fused_ops", "eq", True, "start", False),
        ("features.graph", "eq", True, "start", True),
    },
}

# Where every start requirement of these gates holds: the npu profile over SHM with two ranks,
# and symmetric memory and programmatic launch, which the npu profile lacks.
BASE = ("backend=npu", "engine.transport=shm", "engine.tp=2")
BASE_CAPABILITIES = {"symmetric_memory": True, "programmatic_launch": True, "programmatic_launch_kernels": True}

# The setting that switches each gate on (refuse when a requirement fails).
ON = {
    "graph": "engine.graph=on",
    "async_token_handoff": "engine.async_token_handoff=on",
    "shm_ordered_materialization": "engine.shm.materialization=ordered",
    "fast_allreduce": "engine.fast_allreduce=on",
    "pdl": "engine.pdl=on",
}


@dataclass(frozen=True)
class Failing:
    """How to make exactly one start fact fail: config overrides, or changed capability / model facts."""

    overrides: tuple[str, ...] = ()
    capabilities: Mapping[str, Any] = field(default_factory=dict)
    model: Mapping[str, Any] = field(default_factory=dict)


# Written by hand per fact: a requirement deleted from the YAML still has its case here.
FAILING: dict[str, Failing] = {
    "capabilities.graphs": Failing(capabilities={"graphs": False}),
    "capabilities.streams": Failing(capabilities={"streams": False}),
    "capabilities.events": Failing(capabilities={"events": False}),
    "capabilities.event_query": Failing(capabilities={"event_query": False}),
    "capabilities.async_d2h": Failing(capabilities={"async_d2h": False}),
    "capabilities.pinned_host": Failing(capabilities={"pinned_host": False}),
    "capabilities.device_is_host": Failing(capabilities={"device_is_host": True}),
    "capabilities.pageable_h2d_is_staged": Failing(capabilities={"pageable_h2d_is_staged": True}),
    "features.graph": Failing(overrides=("engine.graph=off",)),
    "features.async_token_handoff": Failing(overrides=("engine.async_token_handoff=off",)),
    "config.engine.kv_cache": Failing(overrides=("engine.kv_cache=contiguous",)),
    "config.engine.speculative_draft_model": Failing(overrides=("engine.speculative_draft_model=draft-model",)),
    "config.engine.kv_transfer_connector": Failing(overrides=("engine.kv_transfer_connector=lmcache",)),
    "config.engine.transport": Failing(overrides=("engine.transport=inproc",)),
    "model.device_decode_inputs": Failing(model={"device_decode_inputs": False}),
    "model.recurrent_state": Failing(overrides=("model=hybrid-tiny",)),
    "config.engine.tp": Failing(overrides=("engine.tp=1",)),
    "capabilities.symmetric_memory": Failing(capabilities={"symmetric_memory": False}),
    "config.model.dtype": Failing(overrides=("model.dtype=float16",)),
    "capabilities.programmatic_launch": Failing(capabilities={"programmatic_launch": False}),
    "capabilities.programmatic_launch_kernels": Failing(capabilities={"programmatic_launch_kernels": False}),
    "features.fused_ops": Failing(overrides=("engine.fused_ops=off",)),
}

# Per-step facts: one request of the batch with exactly this fact failing.
STEP_FACTS = {"multimodal": False, "host_stop_strings": False, "structured_output": False}

START_CASES = sorted(
    (gate, req[0]) for gate, reqs in EXPECTED.items() for req in reqs if req[3] == "start"
)
STEP_CASES = sorted(
    (gate, req[0]) for gate, reqs in EXPECTED.items() for req in reqs if req[3] == "step"
)


@functools.cache
def _compose(overrides: tuple[str, ...]) -> DictConfig:
    return compose_config(list(overrides))


def _loaded(gate: str) -> DictConfig:
    gates = _compose(BASE).features
    assert gate in gates, f"the gate {gate!r} is gone from conf/features"
    node = gates[gate]
    assert isinstance(node, DictConfig), f"features/{gate}.yaml must compose to a mapping"
    return node


def _as_tuple(requirement: DictConfig) -> Requirement:
    value = OmegaConf.to_container(requirement, enum_to_str=True)
    assert isinstance(value, dict), "a requirement composes to a mapping"
    listed = value["value"]  # a list value (op in) compares as a tuple: requirements live in sets
    return (value["fact"], value["op"], tuple(listed) if isinstance(listed, list) else listed, value["scope"],
            value["auto_only"])


def _reason(gate: str, fact: str) -> str:
    """The sentence the YAML gives for ``fact``; the test fails if the requirement is gone."""
    reasons = [str(r.reason) for r in _loaded(gate).requirements if r.fact == fact]
    assert len(reasons) == 1, f"features/{gate}.yaml: expected one requirement on {fact}, found {len(reasons)}"
    return reasons[0]


def _plan(failing: Failing, *overrides: str) -> Plan:
    cfg = _compose((*BASE, *failing.overrides, *overrides))
    typed = OmegaConf.to_object(cfg)
    assert isinstance(typed, CorelibConfig), "the composed config must follow the schema"
    declared = OmegaConf.to_container(cfg.backend.capabilities)
    assert isinstance(declared, dict), "backend.capabilities composes to a mapping"
    capabilities = {**{str(name): value for name, value in declared.items()}, **BASE_CAPABILITIES,
                    **failing.capabilities}
    facts = {**model_facts(typed.model), **failing.model}
    return evaluate(cfg.features, cfg, capabilities, facts)


def _decision(plan: Plan, gate: str) -> Decision:
    return plan.decisions[gate]


@pytest.mark.parametrize("gate", sorted(EXPECTED))
def test_each_gate_has_exactly_the_requirements_written_here(gate: str) -> None:
    loaded = [_as_tuple(r) for r in _loaded(gate).requirements]
    assert len(loaded) == len(set(loaded)), f"features/{gate}.yaml lists a requirement twice"
    missing = EXPECTED[gate] - set(loaded)
    extra = set(loaded) - EXPECTED[gate]
    assert not missing and not extra, f"features/{gate}.yaml: missing {sorted(missing, key=str)}, " \
        f"unexpected {sorted(extra, key=str)}"


def test_every_start_fact_has_a_way_to_fail() -> None:
    assert {fact for _, fact in START_CASES} == set(FAILING)


@pytest.mark.parametrize("gate", sorted(EXPECTED))
def test_the_base_scenario_enables_every_gate(gate: str) -> None:
    decision = _decision(_plan(Failing()), gate)
    assert decision.enabled, f"{gate}: {decision.reasons}"


@pytest.mark.parametrize(("gate", "fact"), START_CASES, ids=[f"{g}:{f}" for g, f in START_CASES])
def test_auto_turns_the_gate_off_when_exactly_this_fact_fails(gate: str, fact: str) -> None:
    decision = _decision(_plan(FAILING[fact]), gate)
    assert not decision.enabled, f"{gate} stayed on although {fact} fails"
    assert _reason(gate, fact) in decision.reasons


@pytest.mark.parametrize(("gate", "fact"), START_CASES, ids=[f"{g}:{f}" for g, f in START_CASES])
def test_on_refuses_unless_the_requirement_only_matters_to_auto(gate: str, fact: str) -> None:
    [auto_only] = [req[4] for req in EXPECTED[gate] if req[0] == fact]
    reason = _reason(gate, fact)
    if auto_only:
        decision = _decision(_plan(FAILING[fact], ON[gate]), gate)
        assert decision.enabled, f"{ON[gate]} must not need {fact}"
        assert f"{reason} (not required when forced)" in decision.reasons
        return
    with pytest.raises(PlanRefused) as refused:
        _plan(FAILING[fact], ON[gate])
    assert (ON[gate], reason) in refused.value.unmet


@pytest.mark.parametrize(("gate", "fact"), STEP_CASES, ids=[f"{g}:{f}" for g, f in STEP_CASES])
def test_a_batch_where_exactly_this_request_fact_fails_runs_synchronously(gate: str, fact: str) -> None:
    plan = _plan(Failing())
    name = fact.removeprefix("request.")
    assert name in STEP_FACTS, f"no request fact {name!r} in this test: add it to STEP_FACTS"
    failing = {**STEP_FACTS, name: True}
    assert plan.step_blockers(gate, [STEP_FACTS, STEP_FACTS]) == []
    assert plan.step_blockers(gate, [STEP_FACTS, failing]) == [_reason(gate, fact)]
