"""The npu backend: torch_npu natively, the stream emulator with the npu profile otherwise."""

from __future__ import annotations

import importlib

from corelib.backend import Backend, DeviceSpec
from corelib.device import Availability, Device
from corelib.errors import UnsupportedOperation


class NPUBackend(Backend):
    name = "npu"

    def _probe_native(self) -> Availability:
        try:
            importlib.import_module("torch_npu")
        except ModuleNotFoundError as error:
            return Availability(native=False, reason=f"torch_npu is not importable ({error})")
        return Availability(native=True, reason="torch_npu imported")

    def _open_native(self, spec: DeviceSpec) -> Device:
        raise UnsupportedOperation("the native npu device is not implemented yet")
