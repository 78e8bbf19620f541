"""A backend plugin from outside ``backends/``: installed only through its entry point.

This is the plugin boundary: the toy plugin under tests/fixtures is not imported by corelib
or by these tests' corelib code paths; a dist-info on PYTHONPATH registers it, and it ships
its own backend YAML.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support import Cli, builtin_entry_points, fixture_entry_points, install_fixture_plugins

from corelib.platform.backend import DeviceSpec, resolve_runtime
from corelib.platform.device import Runtime
from corelib.plugins import PluginRegistry
from corelib.startup.compose import compose_config, prepare_config_store
from corelib.startup.start import start


def test_plan_runs_on_a_third_party_backend(cli: Cli, tmp_path: Path) -> None:
    path = install_fixture_plugins(tmp_path / "site", "toy")
    run_dir = tmp_path / "run"
    result = cli("plan", "backend=toy", f"hydra.run.dir={run_dir}", pythonpath=path)
    assert result.returncode == 0, result.stderr
    assert "corelib: toy: native (toy device on torch" in result.stderr
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["backend"] == "toy"
    assert plan["capabilities"]["device_is_host"] is True  # from the plugin's own toy.yaml
    assert plan["features"]["graph"]["reasons"][0].startswith("the device cannot capture graphs")


@pytest.mark.usefixtures("fixture_plugins_importable", "clean_config_store")
def test_the_third_party_device_works() -> None:
    registry = PluginRegistry(entry_points=fixture_entry_points("toy"))
    prepare_config_store(registry)
    startup = start(compose_config(["backend=toy"]), registry)
    spec: DeviceSpec = resolve_runtime(startup.backend, startup.config.backend, 5.0).spec
    assert spec.runtime is Runtime.native
    with startup.backend.open(spec) as device:
        stream = device.stream()
        src = torch.arange(8, dtype=torch.float32)
        dst = device.empty((8,), torch.float32)
        start_event = device.event(timing=True)
        stream.record(start_event)
        stream.copy(dst, src)

        def double() -> None:
            dst.mul_(2)

        stream.launch(double)
        done = stream.record(device.event(timing=True))
        done.synchronize(timeout=1.0)
        assert done.query()
        assert torch.equal(dst, src * 2)
        assert start_event.elapsed_ms(done) >= 0.0
    assert device.is_closed


@pytest.mark.usefixtures("fixture_plugins_importable", "clean_config_store")
def test_a_plugin_architecture_runs_without_an_edit_of_the_engine() -> None:
    from corelib_toy.model import bigram_table

    from corelib.engine import Engine, SamplingParams

    registry = PluginRegistry(entry_points=[*builtin_entry_points(), *fixture_entry_points("toy")])
    prepare_config_store(registry)
    startup = start(compose_config(["backend=npu", "model.architecture=bigram", "engine.async_token_handoff=on"]),
                    registry)
    table = bigram_table(startup.config.model)
    with Engine(startup) as engine:
        (output,) = engine.generate([[5, 9]], SamplingParams(max_tokens=6, ignore_eos=True))
    expected, token = [], 9
    for _ in range(6):
        token = int(table[token].argmax())
        expected.append(token)
    assert output.output_token_ids == expected
