"""Emulated devices with the real backend profiles, opened per test and always closed."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator

import pytest
from omegaconf import OmegaConf

from corelib.config.schema import EmulatorConfig, register_schemas
from corelib.platform.backend import DeviceSpec
from corelib.platform.device import Capabilities, Runtime
from corelib.platform.emulator import EmulatedDevice
from corelib.startup.compose import load_group_option

OpenDevice = Callable[..., EmulatedDevice]


@functools.cache
def profile(name: str) -> Capabilities:
    """The capabilities that backend <name>'s YAML declares."""
    register_schemas()
    node = load_group_option("backend", name)
    return Capabilities.from_mapping(OmegaConf.to_container(node.capabilities))  # type: ignore[arg-type]


@pytest.fixture
def emulated() -> Iterator[OpenDevice]:
    """Open an emulated device: ``emulated("npu", chaos=0.5, timeout_s=1.0, streams=False)``."""
    opened: list[EmulatedDevice] = []

    def open_device(
        backend: str = "npu", *, timeout_s: float = 5.0, streams: bool = True, **emulator: float
    ) -> EmulatedDevice:
        capabilities = dataclasses.replace(profile(backend), streams=streams)
        spec = DeviceSpec(
            backend=backend,
            runtime=Runtime.emulated,
            capabilities=capabilities,
            emulator=EmulatorConfig(**emulator),  # type: ignore[arg-type]
            timeout_s=timeout_s,
        )
        device = EmulatedDevice(spec)
        opened.append(device)
        return device

    yield open_device
    for device in opened:
        device.close()
        assert device.threads_alive() == [], f"{device.name}: worker threads outlived close()"
