"""The plan as the engine uses it: without async handoff the scheduler never runs ahead."""

from __future__ import annotations

import pytest

from corelib.config.options import EngineOptions
from corelib.plugins import PluginRegistry
from corelib.startup.compose import compose_config
from corelib.startup.start import start


def options(*overrides: str) -> EngineOptions:
    return start(compose_config(["backend=npu", *overrides]), PluginRegistry()).options


@pytest.mark.parametrize("run_ahead", [1, 2])
def test_without_async_handoff_nothing_runs_ahead_whatever_run_ahead_says(run_ahead: int) -> None:
    off = options("engine.async_token_handoff=off", f"engine.run_ahead={run_ahead}")
    assert not off.async_handoff
    assert off.run_ahead == 0 and off.pipeline_depth == 1


@pytest.mark.parametrize("run_ahead", [1, 2])
def test_with_async_handoff_the_scheduler_runs_ahead_as_asked(run_ahead: int) -> None:
    on = options("engine.async_token_handoff=on", f"engine.run_ahead={run_ahead}")
    assert on.async_handoff
    assert on.run_ahead == run_ahead and on.pipeline_depth == run_ahead + 1
