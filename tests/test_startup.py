"""Startup: backend=auto, the runtime of a backend, the probe narrowing capabilities."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import corelib_npu
import pytest
from support import builtin_entry_points

from corelib.errors import BackendUnavailable, ConfigError
from corelib.platform.backend import Backend, DeviceSpec
from corelib.platform.device import Availability, Device, Runtime
from corelib.plugins import PluginRegistry, hookimpl
from corelib.startup.compose import compose_config, prepare_config_store
from corelib.startup.start import Startup, start

pytestmark = pytest.mark.usefixtures("clean_config_store")


class FakeNativeNpu(Backend):
    """Stands in for an npu whose probe finds hardware, narrowing what this version lacks."""

    name = "npu"

    def __init__(self, narrow: Mapping[str, bool]) -> None:
        self.narrow = dict(narrow)

    def _probe_native(self) -> Availability:
        return Availability(native=True, reason="fake Ascend 910B", narrow=self.narrow)

    def _open_native(self, spec: DeviceSpec) -> Device:
        raise NotImplementedError("start() never opens a device")


class FakeNpuPlugin:
    def __init__(self, narrow: Mapping[str, bool] | None = None) -> None:
        self.backend = FakeNativeNpu(narrow or {})

    @hookimpl
    def corelib_backends(self) -> Sequence[Backend]:
        return [self.backend]

    @hookimpl
    def corelib_backend_configs(self) -> dict[str, str]:
        """npu's own YAML, as the real plugin ships it (the tests leave that plugin out)."""
        return {"npu": str(Path(corelib_npu.__file__).with_name("npu.yaml"))}


def _builtin_registry(*, without: str = "") -> PluginRegistry:
    points = [ep for ep in builtin_entry_points() if ep.name != without]
    return PluginRegistry(entry_points=points)


def _start(overrides: Sequence[str], registry: PluginRegistry | None = None) -> Startup:
    registry = registry or _builtin_registry()
    prepare_config_store(registry)
    return start(compose_config(overrides), registry)


def test_auto_falls_back_to_cpu_in_one_short_sentence_and_logs_why(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="corelib.startup"):
        startup = _start([])
    assert startup.spec.backend == "cpu"
    assert startup.raw.backend.name == "cpu"
    assert startup.messages[0] == "backend=auto chose cpu: no cuda, npu or mlu device here (python -m corelib " \
                                  "backends says why)"
    for reason in ("cuda: torch", "npu: torch_npu cannot be imported", "mlu: torch_mlu cannot be imported"):
        assert reason in caplog.text, "the log (run.log) keeps each candidate's reason"


def test_auto_picks_the_first_candidate_that_runs_natively() -> None:
    registry = _builtin_registry(without="npu")
    registry.register(FakeNpuPlugin(), "fake_npu")
    startup = _start([], registry)
    assert startup.spec.backend == "npu"
    assert startup.spec.runtime is Runtime.native
    assert startup.messages[0] == "backend=auto chose npu: it runs natively (fake Ascend 910B)"


@pytest.mark.slow
def test_auto_keeps_what_the_user_set_on_the_backend() -> None:
    registry = _builtin_registry(without="npu")
    registry.register(FakeNpuPlugin(), "fake_npu")
    startup = _start(["backend.device_index=3", "backend.emulator.seed=7"], registry)
    assert startup.spec.device_index == 3
    assert startup.raw.backend.emulator.seed == 7
    assert startup.raw.backend.capabilities.comm_backend == "hccl"  # the rest is npu's own YAML


def test_a_probe_narrows_the_declared_capabilities_and_the_gates_follow() -> None:
    registry = _builtin_registry(without="npu")
    registry.register(FakeNpuPlugin(narrow={"graphs": False}), "fake_npu")
    startup = _start(["backend=npu"], registry)
    assert startup.spec.capabilities.graphs is False
    assert startup.plan.decisions["graph"].reasons == (
        "the device cannot capture graphs (capabilities.graphs is false)",
    )


def test_a_probe_may_not_switch_a_capability_on() -> None:
    registry = _builtin_registry(without="npu")
    registry.register(FakeNpuPlugin(narrow={"device_is_host": True}), "fake_npu")
    with pytest.raises(ConfigError, match=r"backend npu: its probe is invalid"):
        _start(["backend=npu"], registry)


def test_npu_without_torch_npu_runs_emulated_and_says_so_in_one_line() -> None:
    startup = _start(["backend=npu"])
    assert startup.spec.runtime is Runtime.emulated
    assert startup.messages == (
        "npu: running on the stream emulator with the npu profile because "
        "torch_npu cannot be imported (ModuleNotFoundError: No module named 'torch_npu')",
    )


def test_native_runtime_is_refused_where_the_hardware_is_missing() -> None:
    with pytest.raises(
        BackendUnavailable, match=r"backend npu: backend.runtime=native refused: torch_npu cannot be imported"
    ):
        _start(["backend=npu", "backend.runtime=native"])


def test_a_backend_that_cannot_be_emulated_refuses_the_emulated_runtime() -> None:
    with pytest.raises(BackendUnavailable, match=r"backend cpu cannot run on the stream emulator"):
        _start(["backend=cpu", "backend.runtime=emulated"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "+backend.capabilities.graph=false",
            "backend.capabilities.graph: not a capability; fix backend/npu.yaml",
        ),
        ("backend.capabilities.graphs=yes", "backend.capabilities.graphs: expected true or false, got 'yes'"),
        ("backend.capabilities.comm_backend=3", "backend.capabilities.comm_backend: expected a str, got 3"),
    ],
)
def test_a_bad_capability_is_refused_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        _start(["backend=npu", override])
    assert message in str(refused.value)


def test_auto_says_why_a_candidate_plugin_is_not_there(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CORELIB_BLOCK_PLUGINS", "mlu")
    registry = _builtin_registry(without="cuda")
    with caplog.at_level(logging.INFO, logger="corelib.startup"):
        _start([], registry)
    assert "cuda: no plugin installed" in caplog.text
    assert "mlu: plugin blocked (blocked by CORELIB_BLOCK_PLUGINS)" in caplog.text
