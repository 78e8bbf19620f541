"""The mlu backend: torch_mlu natively, the stream emulator with the mlu profile otherwise."""

from __future__ import annotations

import importlib

from corelib.backend import Backend, DeviceSpec
from corelib.device import Availability, Device
from corelib.errors import UnsupportedOperation


class MLUBackend(Backend):
    name = "mlu"

    def _probe_native(self) -> Availability:
        try:
            importlib.import_module("torch_mlu")
        except ModuleNotFoundError as error:
            return Availability(native=False, reason=f"torch_mlu is not importable ({error})")
        return Availability(native=True, reason="torch_mlu imported")

    def _open_native(self, spec: DeviceSpec) -> Device:
        raise UnsupportedOperation("the native mlu device is not implemented yet")
