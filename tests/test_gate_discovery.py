"""Feature gates are found, not listed: every conf/features/*.yaml and every plugin's gate is composed.

A plugin's gate (the fixture ``corelib_oddities.gates``) joins the default ``features=all``, and
its mode key, ``engine.toy_warmup``, exists because the gate names it: no schema declares it.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from collections.abc import Iterator

import pytest
from omegaconf import OmegaConf
from support import builtin_entry_points, fixture_entry_points

from corelib.config.gate_catalog import read_gate, shipped_gate_files
from corelib.config.schema import CorelibConfig, EngineConfig, Mode
from corelib.errors import ConfigError, PlanRefused
from corelib.plugins import PluginRegistry
from corelib.startup.compose import compose_config, prepare_config_store
from corelib.startup.plugin_catalog import PluginCatalog
from corelib.startup.start import start

# The plan's rows before the gates were found rather than listed; a gate added since may sit anywhere.
FIRST_GATES = ["graph", "async_token_handoff", "shm_ordered_materialization", "fused_ops", "fast_allreduce", "pdl"]


def shipped_in_order() -> list[str]:
    orders = {name: read_gate(name, path, name).order for name, path in shipped_gate_files().items()}
    return sorted(orders, key=lambda name: (orders[name], name))


@pytest.fixture
def with_gate_plugin(fixture_plugins_importable: None, clean_config_store: None) -> Iterator[PluginRegistry]:
    """The built-in plugins and one that ships a gate; afterwards the built-in plugins' gates again."""
    registry = PluginRegistry(entry_points=[*builtin_entry_points(), *fixture_entry_points("gates")])
    prepare_config_store(registry)
    yield registry
    prepare_config_store(PluginRegistry())


def test_the_default_gates_are_every_gate_file_in_plan_order() -> None:
    assert set(FIRST_GATES) <= set(shipped_gate_files())
    assert list(compose_config([]).features) == shipped_in_order()
    plan = start(compose_config(["backend=npu"]), PluginRegistry()).plan
    assert list(plan.decisions) == shipped_in_order(), "the plan keeps its rows in the order of the gates' order keys"
    assert [name for name in plan.decisions if name in FIRST_GATES] == FIRST_GATES, "the first gates kept their rows"


def test_one_gate_is_still_an_option_of_its_own() -> None:
    assert list(compose_config(["features=[pdl,graph]"]).features) == ["pdl", "graph"]


@pytest.mark.slow
def test_a_plugin_gate_joins_the_plan_switched_at_the_engine_key_it_declares(
    with_gate_plugin: PluginRegistry,
) -> None:
    assert list(compose_config([]).features) == [*shipped_in_order(), "toy_warmup"]  # its order: the default 100
    auto = start(compose_config(["backend=npu"]), with_gate_plugin).plan.decisions["toy_warmup"]
    assert (auto.mode_key, auto.mode_value, auto.enabled) == ("engine.toy_warmup", "auto", True)
    off = start(compose_config(["backend=npu", "engine.toy_warmup=off"]), with_gate_plugin).plan
    assert off.decisions["toy_warmup"].reasons == ("switched off by engine.toy_warmup=off",)
    with pytest.raises(PlanRefused) as refused:
        start(compose_config(["backend=cuda", "engine.toy_warmup=on", "engine.graph=off"]), with_gate_plugin)
    assert ("engine.toy_warmup=on", "graphs are off, and only captured graphs are warmed up") in refused.value.unmet


@pytest.mark.parametrize(("override", "fragments"), [
    ("engine.toy_wramup=on", ["engine.toy_wramup", "did you mean 'toy_warmup'?"]),
    ("+engine.toy_wramup=on", ["engine.toy_wramup: not a config key", "did you mean 'toy_warmup'?"]),
    ("engine.toy_warmup=sometimes", ["engine.toy_warmup", "sometimes", "auto, on, off"]),
])
def test_a_declared_engine_key_is_checked_like_the_schema_s_own(
    with_gate_plugin: PluginRegistry, override: str, fragments: list[str]
) -> None:
    with pytest.raises(ConfigError) as refused:
        compose_config([override])
    message = str(refused.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_a_config_with_a_declared_key_reaches_another_process_whole(with_gate_plugin: PluginRegistry) -> None:
    typed = OmegaConf.to_object(compose_config(["engine.toy_warmup=on", "engine.max_num_seqs=3"]))
    assert isinstance(typed, CorelibConfig) and isinstance(typed.engine, EngineConfig)
    # A worker unpickles its config in a fresh interpreter that never composed one.
    read = "import pickle, sys; c = pickle.load(sys.stdin.buffer); print(c.engine.toy_warmup.value, " \
           "c.engine.max_num_seqs)"
    done = subprocess.run([sys.executable, "-c", read], input=pickle.dumps(typed), capture_output=True, check=False)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().split() == [Mode.on.value, "3"]


def test_the_torch_free_catalog_carries_the_plugin_gates(with_gate_plugin: PluginRegistry) -> None:
    catalog = PluginCatalog.from_json(PluginCatalog.of(with_gate_plugin).to_json())
    assert catalog.feature_files == with_gate_plugin.feature_files
    assert list(catalog.feature_files) == ["toy_warmup"]


@pytest.mark.usefixtures("fixture_plugins_importable")
def test_a_plugin_may_not_ship_a_gate_under_a_taken_name() -> None:
    registry = PluginRegistry(entry_points=fixture_entry_points("gates", "clashing_gate"))
    record = registry.records["clashing_gate"]
    assert record.status == "failed"
    assert "gate 'graph', which corelib ships already" in record.error
    assert registry.records["gates"].status == "loaded" and list(registry.feature_files) == ["toy_warmup"]
