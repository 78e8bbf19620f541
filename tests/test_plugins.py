"""Backend plugins: discovery through entry points, broken and conflicting plugins, restrictions."""

from __future__ import annotations

import ast
import importlib.metadata
import threading
from pathlib import Path

import pytest
from support import builtin_entry_points, fixture_entry_points

import corelib
from corelib import plugins
from corelib.errors import PluginError
from corelib.plugins import PluginRegistry, hookimpl
from corelib.startup.compose import compose_config, prepare_config_store
from corelib.startup.start import start

BUILTINS = {"cpu", "cuda", "npu", "mlu"}
pytestmark = pytest.mark.usefixtures("fixture_plugins_importable")


def test_the_four_builtin_plugins_are_found_through_the_entry_point_group() -> None:
    registry = PluginRegistry()
    assert set(registry.backend_names) >= BUILTINS
    for name in BUILTINS:
        record = registry.records[name]
        assert record.status == "loaded", record.error
        assert record.backends == [name]
        assert record.distribution.startswith(f"corelib-{name} ")


def test_the_core_imports_no_backend_and_no_vendor_sdk() -> None:
    forbidden = ("corelib_cpu", "corelib_cuda", "corelib_npu", "corelib_mlu", "torch_npu", "torch_mlu")
    offenders = []
    for path in Path(corelib.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in forbidden]
    assert not offenders


def test_a_plugin_that_fails_to_import_is_reported_and_skipped() -> None:
    registry = PluginRegistry(entry_points=[*builtin_entry_points(), *fixture_entry_points("broken")])
    record = registry.records["broken"]
    assert record.status == "failed"
    assert "corelib_oddities.broken" in record.error
    assert "libtoy.so: cannot open shared object file" in record.error
    assert set(registry.backend_names) == BUILTINS


def test_selecting_a_plugin_that_failed_to_load_is_a_clear_error() -> None:
    registry = PluginRegistry(entry_points=fixture_entry_points("broken"))
    with pytest.raises(
        PluginError, match=r"backend 'broken': plugin 'broken'.*failed to load:.*libtoy\.so.*reinstall"
    ):
        registry.get("broken")


def test_two_plugins_claiming_one_backend_is_an_error_naming_both() -> None:
    registry = PluginRegistry(entry_points=[*builtin_entry_points(), *fixture_entry_points("second_cpu")])
    assert registry.conflicts == {"cpu": ["cpu", "second_cpu"]}
    with pytest.raises(PluginError) as refused:
        registry.get("cpu")
    message = str(refused.value)
    assert "'cpu' (corelib-cpu 0.1.0)" in message
    assert "'second_cpu'" in message
    assert "CORELIB_BLOCK_PLUGINS=second_cpu" in message
    assert registry.get("npu").name == "npu"  # the other backends stay usable


def test_two_entry_points_with_one_name_are_both_skipped_and_the_rest_load() -> None:
    twice = [
        *fixture_entry_points("toy", "no_backends"),
        importlib.metadata.EntryPoint("toy", "corelib_oddities.second_cpu", "corelib.backends"),
    ]
    registry = PluginRegistry(entry_points=[*twice, *builtin_entry_points()])
    assert registry.records["toy"].status == "failed"
    assert "2 installed distributions register plugin 'toy'" in registry.records["toy"].error
    assert "toy" not in registry.backend_names and "npu" in registry.backend_names
    with pytest.raises(PluginError, match=r"backend 'toy': plugin 'toy' .* failed to load: 2 installed distributions"):
        registry.get("toy")


def test_one_distribution_seen_twice_is_one_plugin() -> None:
    registry = PluginRegistry(entry_points=[*fixture_entry_points("toy"), *fixture_entry_points("toy")])
    assert registry.records["toy"].status == "loaded"


@pytest.mark.parametrize(
    ("plugin", "error"),
    [
        ("misspelled_hook", "corelib_backend"),
        ("no_backends", "provides no backend"),
        ("wrong_type", "hook corelib_backends returned a str; expected instances of corelib.backend.Backend"),
        ("foreign_config", "config for backend 'somebody_else', which the plugin does not provide"),
    ],
)
def test_a_plugin_that_breaks_the_hook_contract_is_reported(plugin: str, error: str) -> None:
    registry = PluginRegistry(entry_points=fixture_entry_points(plugin, "toy"))
    assert registry.records[plugin].status == "failed"
    assert error in registry.records[plugin].error
    assert registry.backend_names == ["toy"]


def test_a_third_party_plugin_ships_its_own_backend_config() -> None:
    registry = PluginRegistry(entry_points=fixture_entry_points("toy"))
    assert registry.backend_names == ["toy"]
    assert registry.config_files["toy"].name == "toy.yaml"
    assert "corelib_toy" in registry.trusted_packages


NOT_IN_ENV = "not in CORELIB_PLUGINS (cpu, npu)"


@pytest.mark.parametrize(
    ("env", "allow", "block", "blocked"),
    [
        ({"CORELIB_PLUGINS": "cpu,npu"}, None, [], {"cuda": NOT_IN_ENV, "mlu": NOT_IN_ENV}),
        (
            {"CORELIB_BLOCK_PLUGINS": "npu, mlu"},
            None,
            [],
            dict.fromkeys(["npu", "mlu"], "blocked by CORELIB_BLOCK_PLUGINS"),
        ),
        ({}, ["cuda"], [], dict.fromkeys(["cpu", "npu", "mlu"], "not in plugins.allow (cuda)")),
        ({}, None, ["cuda", "cpu"], dict.fromkeys(["cuda", "cpu"], "blocked by plugins.block")),
        (
            {"CORELIB_PLUGINS": "cpu,npu"},
            ["npu", "mlu"],
            [],
            {"cpu": "not in plugins.allow (mlu, npu)", "cuda": NOT_IN_ENV, "mlu": NOT_IN_ENV},
        ),
        (
            {"CORELIB_PLUGINS": "cpu,npu"},
            None,
            ["npu"],
            {"npu": "blocked by plugins.block", "cuda": NOT_IN_ENV, "mlu": NOT_IN_ENV},
        ),
    ],
)
def test_environment_variables_and_config_keys_restrict_loading(
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    allow: list[str] | None,
    block: list[str],
    blocked: dict[str, str],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    registry = PluginRegistry(allow=allow, block=block, entry_points=builtin_entry_points())
    assert set(registry.backend_names) == BUILTINS - set(blocked)
    reasons = {r.name: r.error for r in registry.records.values() if r.status == "blocked"}
    assert reasons == blocked


def test_a_blocked_plugin_is_not_even_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORELIB_BLOCK_PLUGINS", "broken")
    registry = PluginRegistry(entry_points=fixture_entry_points("broken", "toy"))
    assert registry.records["broken"].status == "blocked"  # not failed: its import never ran
    with pytest.raises(
        PluginError, match=r"plugin 'broken' is not loaded \(blocked by CORELIB_BLOCK_PLUGINS\)"
    ):
        registry.get("broken")


@pytest.mark.usefixtures("clean_config_store")
def test_the_composed_plugins_keys_are_checked_again_at_start() -> None:
    registry = PluginRegistry(entry_points=builtin_entry_points())  # loaded before the config was known
    prepare_config_store(registry)
    cfg = compose_config(["backend=npu", "plugins.allow=[cpu]"])
    with pytest.raises(
        PluginError, match=r"backend 'npu' comes from plugin 'npu', which plugins.allow/block excludes"
    ):
        start(cfg, registry)


def test_an_unknown_backend_names_the_installed_ones_and_those_that_did_not_load() -> None:
    registry = PluginRegistry(entry_points=[*builtin_entry_points(), *fixture_entry_points("broken")])
    with pytest.raises(PluginError) as refused:
        registry.get("tpu")
    assert "installed backends: cpu, cuda, mlu, npu; plugins not loaded: broken (failed)" in str(
        refused.value
    )


class _HookThatNeverReturns:
    """A plugin whose corelib_backends waits for an event nobody sets (until the test lets it go)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    @hookimpl
    def corelib_backends(self) -> list[object]:
        self.release.wait(600)
        return []


def test_a_registered_plugin_whose_hook_never_returns_fails_naming_the_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugins, "HOOK_TIMEOUT_S", 0.5)  # the hook never returns: any bound shows the refusal
    registry = PluginRegistry(entry_points=builtin_entry_points())
    plugin = _HookThatNeverReturns()
    try:
        refused = r"plugin 'stuck' failed to register: RuntimeError: hook corelib_backends did not return within 0\.5 s"
        with pytest.raises(PluginError, match=refused):
            registry.register(plugin, "stuck")
        assert registry.records["stuck"].status == "failed"
        assert "cpu" in registry.backend_names, "the other plugins are unharmed"
    finally:
        plugin.release.set()
