"""The cuda backend: torch.cuda natively, the stream emulator with the cuda profile otherwise."""

from __future__ import annotations

import torch

from corelib.backend import Backend, DeviceSpec
from corelib.device import Availability, Device
from corelib.errors import UnsupportedOperation


class CUDABackend(Backend):
    name = "cuda"

    def _probe_native(self) -> Availability:
        if not torch.cuda.is_available():
            return Availability(native=False, reason=f"torch {torch.__version__} sees no CUDA device")
        return Availability(native=True, reason=f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")

    def _open_native(self, spec: DeviceSpec) -> Device:
        raise UnsupportedOperation("the native cuda device is not implemented yet")
