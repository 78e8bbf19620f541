"""The plan as the engine uses it: without async handoff the scheduler never runs ahead."""

from __future__ import annotations

import pytest

from corelib.config.options import EngineOptions, run_ahead_for
from corelib.config.schema import Transport
from corelib.platform.device import Capabilities
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


@pytest.mark.parametrize(("transport", "device_is_host", "expected"),
                         [(Transport.inproc, False, 1), (Transport.shm, False, 2), (Transport.shm, True, 1)])
def test_unset_run_ahead_is_two_steps_only_over_shm_to_a_worker_that_runs_a_device(
        transport: Transport, device_is_host: bool, expected: int) -> None:
    # Over SHM the step after next comes back through the worker's results and the ring: two steps to hide in. A
    # worker that computes on the host (the cpu backend) hides the hop behind its own step.
    assert run_ahead_for(None, transport, Capabilities(device_is_host=device_is_host)) == expected
    assert run_ahead_for(1, transport, Capabilities(device_is_host=device_is_host)) == 1


def test_the_default_config_leaves_run_ahead_to_startup() -> None:
    # Nothing in the composed config sets it: the emulated npu is a device apart from the host, the cpu is not.
    assert compose_config(["backend=npu"]).engine.run_ahead is None
    assert options("engine.async_token_handoff=on").run_ahead == 1
    shm = options("engine.async_token_handoff=on", "engine.transport=shm")
    assert shm.run_ahead == 2 and shm.pipeline_depth == 3
    assert options("engine.async_token_handoff=on", "engine.transport=shm", "engine.run_ahead=1").run_ahead == 1
    cpu = start(compose_config(["backend=cpu", "engine.transport=shm"]), PluginRegistry()).options
    assert cpu.run_ahead == 1
