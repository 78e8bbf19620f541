"""What conf/features states about how chunked prefill and prefix caching combine with the other gates,
read from the YAML and run: both gates on give the tokens of both off, on emulated npu under chaos."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from support import EngineFactory

from corelib.engine import Engine, SamplingParams
from corelib.errors import PlanRefused

FEATURES = Path(__file__).parent.parent / "conf" / "features"
GATES = ("chunked_prefill", "prefix_caching")
# How each gate is switched on, with what it needs around it (ordered SHM needs the SHM transport).
SWITCH = {
    "chunked_prefill": ["engine.chunked_prefill=on", "engine.max_num_batched_tokens=16"],
    "prefix_caching": ["engine.prefix_caching=on"],
    "async_token_handoff": ["engine.async_token_handoff=on"],
    "graph": ["engine.graph=on"],
    "shm_ordered_materialization": ["engine.transport=shm", "engine.shm.materialization=ordered",
                                    "engine.async_token_handoff=on"],
}
OFF = {"chunked_prefill": ["engine.chunked_prefill=off"], "prefix_caching": ["engine.prefix_caching=off"]}
BASE = ["backend=npu", "backend.emulator.chaos=0.2", "backend.emulator.chaos_max_ms=0.3", "model.max_model_len=256",
        "engine.max_num_seqs=4"]


def combinations() -> list[tuple[str, str, str]]:
    found = []
    for gate in GATES:
        spec = OmegaConf.to_container(OmegaConf.load(FEATURES / f"{gate}.yaml"))
        assert isinstance(spec, dict)
        found += [(gate, str(c["feature"]), str(c["rule"])) for c in spec[gate]["combines"]]
    return found


def requests() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(5)
    shared = [rng.randrange(2, 500) for _ in range(40)]
    return [((shared if i % 2 else []) + [rng.randrange(2, 500) for _ in range(rng.randint(1, 60))],
             SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True)) for i in range(8)]


def tokens(engine: Engine) -> list[list[int]]:
    outputs = []
    for prompt, sampling in requests():  # one after another: a later prompt finds the earlier one's blocks
        outputs += [o.output_token_ids for o in engine.generate([prompt], sampling)]
    return outputs


def test_every_stated_combination_names_a_gate_and_says_what_holds() -> None:
    known = {path.stem for path in FEATURES.glob("*.yaml")}
    stated = combinations()
    assert {(gate, other) for gate, other, _ in stated} >= {
        ("chunked_prefill", "async_token_handoff"), ("chunked_prefill", "shm_ordered_materialization"),
        ("prefix_caching", "async_token_handoff"), ("prefix_caching", "shm_ordered_materialization")}
    for gate, other, rule in stated:
        assert other in known, f"{gate} states how it combines with {other!r}, which is no gate"
        assert len(rule) > 40, f"{gate} with {other}: say what holds"


@pytest.fixture(scope="module")
def baseline() -> list[list[int]]:
    with Engine.from_overrides([*BASE, "backend.emulator.chaos=0", *OFF["chunked_prefill"],
                                *OFF["prefix_caching"]]) as engine:
        return tokens(engine)


@pytest.mark.parametrize(("gate", "other", "rule"), combinations(), ids=lambda v: v if len(v) < 40 else "")
@pytest.mark.slow
def test_a_stated_combination_runs_and_gives_the_tokens_of_neither(
        make_engine: EngineFactory, baseline: list[list[int]], gate: str, other: str, rule: str) -> None:
    overrides = [*BASE, *SWITCH[gate], *SWITCH[other]]
    for rest in GATES:
        if rest not in (gate, other):
            overrides += OFF[rest]
    engine = make_engine(overrides)
    assert engine.plan.is_enabled(gate) and engine.plan.is_enabled(other), engine.plan.as_dict()
    assert engine.plan.decisions[gate].as_dict()["combines"][other] == rule, "plan.json carries the rule"
    assert tokens(engine) == baseline


@pytest.mark.slow
def test_on_refuses_naming_each_unmet_requirement(make_engine: EngineFactory) -> None:
    with pytest.raises(PlanRefused, match="recurrent state per sequence"):
        make_engine(["backend=cpu", "model=hybrid-tiny", "engine.prefix_caching=on"])
    with pytest.raises(PlanRefused, match="a chunk attends to the blocks cached before it"):
        make_engine(["backend=cpu", "engine.kv_cache=contiguous", "engine.chunked_prefill=on",
                     "engine.async_token_handoff=off"])
    engine = make_engine(["backend=cpu", "model=hybrid-tiny"])
    assert engine.plan.is_enabled("chunked_prefill") and not engine.plan.is_enabled("prefix_caching")
    assert any("recurrent" in reason for reason in engine.plan.decisions["prefix_caching"].reasons)
