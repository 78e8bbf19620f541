"""No code from config: a ``_target_`` may only point into corelib and the loaded plugins."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf
from support import builtin_entry_points, fixture_entry_points

from corelib.errors import ConfigError
from corelib.plugins import PluginRegistry
from corelib.startup.compose import check_targets, compose_config, prepare_config_store
from corelib.startup.start import start

TRUSTED = ["corelib", "corelib_toy"]


def _cfg(node: Any) -> DictConfig:
    cfg = OmegaConf.create(node)
    assert isinstance(cfg, DictConfig), "the test config must be a mapping"
    return cfg


@pytest.mark.usefixtures("fixture_plugins_importable")
@pytest.mark.parametrize(
    "target",
    ["corelib.observe.rundir.RunDir", "corelib.config.features.evaluate", "corelib_toy.device.ToyBackend"],
)
def test_targets_inside_corelib_and_the_plugins_are_allowed(target: str) -> None:
    check_targets(_cfg({"engine": {"sampler": {"_target_": target}}}), TRUSTED)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("os.system", "engine.sampler._target_: _target_ 'os.system' is refused"),
        (
            "subprocess.run",
            "'subprocess.run' is refused: configs may only build objects from corelib, corelib_toy",
        ),
        ("corelib_toyx.run", "'corelib_toyx.run' is refused"),  # a prefix is a whole package name
        ("corelib.cli.main.os.system", "it is defined in posix"),  # re-exported by a corelib module
        ("corelib.cli.hydra_app.Path", "it is defined in pathlib"),
        ("corelib.nothing.here", "cannot be found"),
    ],
)
def test_targets_outside_are_refused_in_one_line(target: str, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        check_targets(_cfg({"engine": {"sampler": {"_target_": target}}}), TRUSTED)
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_targets_are_found_in_lists_and_after_interpolation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORELIB_TEST_TARGET", "os.system")
    cfg = _cfg({"hooks": [{"ok": 1}, {"_target_": "${oc.env:CORELIB_TEST_TARGET}"}]})
    with pytest.raises(ConfigError, match=r"hooks\[1\]\._target_: _target_ 'os.system' is refused"):
        check_targets(cfg, TRUSTED)


@pytest.mark.usefixtures("clean_config_store")
def test_start_refuses_a_target_given_as_an_override() -> None:
    registry = PluginRegistry(entry_points=builtin_entry_points())
    prepare_config_store(registry)
    cfg = compose_config(["backend=npu", "+features.graph.requirements.0.value={_target_: os.system}"])
    with pytest.raises(
        ConfigError, match=r"features\.graph\.requirements\[0\]\.value\._target_: .*'os.system' is refused"
    ):
        start(cfg, registry)


@pytest.mark.usefixtures("clean_config_store", "fixture_plugins_importable")
def test_start_refuses_a_target_in_a_plugin_yaml_and_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "ran"
    monkeypatch.setenv("CORELIB_TEST_MARKER", str(marker))
    registry = PluginRegistry(entry_points=fixture_entry_points("evil"))
    prepare_config_store(registry)
    # The plugin's YAML reads the environment: refused as composed, like any config file's.
    with pytest.raises(ConfigError, match=r"comm_backend\.command: refused: .*may not read the environment"):
        compose_config(["backend=evil"])
    cfg = compose_config(["backend=evil", f"backend.capabilities.comm_backend.command=touch {marker}"])
    with pytest.raises(
        ConfigError, match=r"backend\.capabilities\.comm_backend\._target_: .*'os.system' is refused"
    ):
        start(cfg, registry)
    assert not marker.exists()
