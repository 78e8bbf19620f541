"""The config tree: every option of every group composes, and the schema refuses mistakes."""

from __future__ import annotations

import dataclasses
import importlib.resources
from typing import TYPE_CHECKING

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from corelib.config.schema import CorelibConfig, register_schemas
from corelib.errors import ConfigError
from corelib.platform.backend import declared_capabilities
from corelib.platform.device import Capabilities
from corelib.startup.compose import compose_config

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

CONF = importlib.resources.files("corelib.conf")


def _groups() -> dict[str, list[str]]:
    """Every config group and its options: the shipped tree's YAML files, and the backends the plugins ship."""
    from corelib.plugins import PluginRegistry

    groups: dict[str, list[str]] = {}
    for folder in CONF.iterdir():
        if folder.is_dir():
            options = sorted(f.name[: -len(".yaml")] for f in folder.iterdir() if f.name.endswith(".yaml"))
            if options:
                groups[folder.name] = options
    groups["backend"] = sorted({*groups.get("backend", []), *PluginRegistry().config_files})
    return groups


def _option_override(group: str, option: str) -> str:
    # features is a list of gates in the defaults, so one option is selected as a one-item list
    return f"{group}=[{option}]" if group == "features" else f"{group}={option}"


GROUP_OPTIONS = [(group, option) for group, options in sorted(_groups().items()) for option in options]


def test_the_tree_has_the_groups_of_the_design() -> None:
    assert {"backend", "model", "engine", "workload", "features"} <= set(_groups())
    assert {"auto", "cpu", "cuda", "npu", "mlu"} <= set(_groups()["backend"])


@pytest.mark.parametrize(("group", "option"), GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_option_of_every_group_composes_into_the_schema(group: str, option: str) -> None:
    cfg = compose_config([_option_override(group, option)])
    typed = OmegaConf.to_object(cfg)
    assert isinstance(typed, CorelibConfig)
    if group == "features":
        assert list(cfg.features) == [option]
    elif group in ("backend", "model"):
        assert cfg[group].name == option


def test_every_gate_file_is_in_the_default_feature_list() -> None:
    gates = set(_groups()["features"])
    assert set(compose_config([]).features) == gates


@pytest.mark.parametrize("backend", [b for b in _groups()["backend"] if b != "auto"])
def test_every_backend_yaml_declares_every_capability_with_its_type(backend: str) -> None:
    capabilities = compose_config([f"backend={backend}"]).backend.capabilities
    assert set(capabilities) == {f.name for f in dataclasses.fields(Capabilities)}
    declared_capabilities(backend, OmegaConf.to_container(capabilities))  # type: ignore[arg-type]


def _yaml_key_lines(entry: Traversable) -> list[str]:
    lines = []
    for line in entry.read_text().splitlines():
        text = line.strip()
        if text and not text.startswith(("#", "-")) and ":" in text:
            lines.append(line)
    return lines


# Gates are lists of records whose ``reason`` already says what each one means.
COMMENTED = [(g, o) for g, o in GROUP_OPTIONS if g != "features"]


@pytest.mark.parametrize(("group", "option"), COMMENTED, ids=[f"{g}={o}" for g, o in COMMENTED])
def test_every_leaf_key_of_the_shipped_yaml_has_a_comment(group: str, option: str) -> None:
    from pathlib import Path

    from corelib.plugins import PluginRegistry

    shipped = PluginRegistry().config_files  # the built-in backends ship their YAML with their plugin
    entry: Traversable | Path = CONF / group / f"{option}.yaml"
    if group == "backend" and option in shipped:
        entry = shipped[option]
    uncommented = [
        line.strip()
        for line in _yaml_key_lines(entry)
        if "#" not in line and not line.rstrip().endswith(":")  # a mapping's key heads a block
    ]
    assert not uncommented, f"{group}/{option}.yaml: keys without a comment: {uncommented}"


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("engine.grahp=on", ["engine.grahp", "did you mean 'graph'?"]),
        ("engine.shm.num_slot=2", ["engine.shm.num_slot", "did you mean 'num_slots'?"]),
        ("+engine.grahp=on", ["engine.grahp: not a config key", "did you mean 'graph'?"]),
        ("+model.colour=red", ["model.colour: not a config key", "the keys of model are: name"]),
        ("engine.graph=maybe", ["engine.graph", "maybe", "auto, on, off"]),
        ("backend.runtime=sometimes", ["backend.runtime", "auto, native, emulated"]),
        ("engine.shm.materialization=later", ["engine.shm.materialization", "auto, early, ordered"]),
        ("engine.max_num_seqs=lots", ["engine.max_num_seqs", "lots"]),
        ("workload.temperature=hot", ["workload.temperature", "hot"]),
        ("model=huge", ["model=huge: no such option", "small-0.6b, tiny"]),
        ("engine.graph=[", ["cannot parse the override 'engine.graph=['"]),
    ],
)
def test_the_schema_refuses_a_bad_override_naming_the_full_key(override: str, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as refused:
        compose_config([override])
    message = str(refused.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


@pytest.mark.usefixtures("clean_config_store")
@pytest.mark.parametrize(
    ("node", "fragments"),
    [
        ({"name": "typo", "runtme": "native"}, ["backend.runtme", "did you mean 'runtime'?"]),
        ({"name": "typo", "device_index": "first"}, ["backend.device_index", "first"]),
        ({"name": "typo", "runtime": "always"}, ["backend.runtime", "auto, native, emulated"]),
    ],
)
def test_the_schema_refuses_a_bad_yaml_naming_the_full_key(
    node: dict[str, str], fragments: list[str]
) -> None:
    register_schemas()
    ConfigStore.instance().store(group="backend", name="typo", node=node)
    with pytest.raises(ConfigError) as refused:
        compose_config(["backend=typo"])
    for fragment in fragments:
        assert fragment in str(refused.value)


@pytest.mark.usefixtures("clean_config_store")
def test_the_schema_refuses_a_misspelled_key_in_a_gate_file() -> None:
    register_schemas()
    gate = {"typo_gate": {"mode": "auto", "requirments": []}}
    ConfigStore.instance().store(group="features", name="typo_gate", node=gate)
    with pytest.raises(ConfigError, match=r"features\.typo_gate\.requirments.*did you mean 'requirements'"):
        compose_config(["features=[graph,typo_gate]"])
