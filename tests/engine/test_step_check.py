"""The async gate's per-step requirements: decided once per request, a step's decision the union of its rows."""

from __future__ import annotations

import functools
import random
from collections.abc import Mapping
from typing import Any

import pytest

from corelib.config.features import Requirement, failing_step_requirements
from corelib.config.options import StepCheck
from corelib.engine.sequence import SamplingParams, Sequence
from corelib.plugins import PluginRegistry
from corelib.startup.compose import compose_config
from corelib.startup.start import start
from corelib.testing.executor import scripted_core, unit_options


@functools.cache
def yaml_check() -> StepCheck:
    """The StepCheck startup builds from conf/features/async_token_handoff.yaml (emulated npu, async on)."""
    options = start(compose_config(["backend=npu", "engine.async_token_handoff=on"]), PluginRegistry()).options
    assert options.step_check.requirements, "the async gate lost its per-step requirements"
    return options.step_check


def interpreted(check: StepCheck, seqs: list[Sequence]) -> list[str]:
    """The decision as the requirement interpreter makes it from every row's facts, for the batch at hand."""
    facts: list[Mapping[str, Any]] = [
        {"multimodal": s.multimodal, "host_stop_strings": bool(s.sampling.stop_strings),
         "structured_output": s.grammar is not None} for s in seqs
    ]
    return failing_step_requirements(check.requirements, facts)


def battery(count: int, rng: random.Random) -> list[Sequence]:
    seqs = []
    for number in range(count):
        stops = ("\n\n",) if rng.random() < 0.2 else ()
        sampling = SamplingParams(max_tokens=8, temperature=rng.choice([0.0, 0.7]), stop=stops)
        seqs.append(Sequence(number, f"r{number}", [3, 4, 5], sampling, multimodal=rng.random() < 0.15))
    return seqs


def test_a_steps_reasons_are_the_interpreters_on_a_battery_of_mixed_batches() -> None:
    check = yaml_check()
    rng = random.Random(7)
    seqs = battery(200, rng)
    for seq in seqs:
        seq.sync_mask = check.facts_of(seq)
    seen = set()
    for _ in range(400):
        batch = rng.sample(seqs, rng.choice([1, 2, 3, 8, 32, 64]))
        expected = interpreted(check, batch)
        assert check.reasons(batch) == expected, [(s.multimodal, s.sampling.stop_strings) for s in batch]
        seen.add(tuple(expected))
    both = tuple(r.reason for r in check.requirements)[:2]  # multimodal, stop strings (the battery has no grammar)
    assert {(), both, both[:1], both[1:]} <= seen, f"the battery did not cover every combination: {seen}"


def test_a_request_added_without_its_facts_gets_them_on_first_use() -> None:
    check = yaml_check()
    seq = Sequence(0, "r0", [3], SamplingParams(stop=("x",)), multimodal=True)
    assert seq.sync_mask is None
    assert check.reasons([seq]) == interpreted(check, [seq])
    assert seq.sync_mask == check.facts_of(seq) != 0


def test_the_steps_never_run_the_requirement_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    check = yaml_check()
    calls = {"n": 0}
    real = Requirement.holds

    def spy(self: Requirement, facts: Mapping[str, Any]) -> bool:
        calls["n"] += 1
        return real(self, facts)

    monkeypatch.setattr(Requirement, "holds", spy)
    core, _ = scripted_core(options=unit_options(run_ahead=1, step_check=check))
    rng = random.Random(3)
    for seq in [*battery(4, rng), Sequence(9, "mm", [7, 8], SamplingParams(max_tokens=8), multimodal=True)]:
        core.add(seq)
    per_request = calls["n"]
    assert per_request == 5 * len(check.requirements), "each request's facts are evaluated once, when it is added"
    steps = 0
    while core.iterate():
        steps += 1
    assert steps > 8 and core.metrics.sync_reasons, "the steps ran, and some of them synchronously"
    assert calls["n"] == per_request, f"{calls['n'] - per_request} requirement evaluations in {steps} steps"
