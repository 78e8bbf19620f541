"""The mlu backend: torch_mlu natively, the stream emulator with the mlu profile otherwise.

Vendor APIs used, all from the Cambricon/torch_mlu repository (package torch_mlu):
- ``torch.mlu.Stream``, ``Event(enable_timing, blocking, interprocess)``: torch_mlu/mlu/streams.py
- ``torch.mlu.MLUGraph``, ``graph(mlu_graph, pool, stream, capture_error_mode="relaxed")``,
  ``graph_pool_handle``: torch_mlu/mlu/graphs.py (relaxed is torch_mlu's default capture mode)
- ``torch.mlu.device_count``, which honours MLU_VISIBLE_DEVICES (and CN_VISIBLE_DEVICES):
  torch_mlu/mlu/__init__.py
torch_mlu binds no host registration (its ``torch.mlu.cnrt()`` module exposes only error
strings and the profiler), so ``host_register`` stays false in conf/backend/mlu.yaml.
The fused ops (torch_mlu_ops kernels) are offered through ``op_provider``: corelib_mlu/ops.py.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import TYPE_CHECKING

from corelib.backend import Backend, DeviceSpec
from corelib.device import Availability, Device
from corelib.errors import BackendUnavailable, one_line
from corelib.native import TorchDevice

if TYPE_CHECKING:
    from corelib.ops import OpProvider

VISIBLE_ENV = "MLU_VISIBLE_DEVICES"


def _import_torch_mlu() -> ModuleType:
    # Imported here, not at corelib import: a broken install becomes this plugin's reason.
    return importlib.import_module("torch_mlu")


def _visible() -> str:
    return f"{VISIBLE_ENV}={os.environ.get(VISIBLE_ENV)!r}"


class MluDevice(TorchDevice):
    graph_class = "MLUGraph"
    capture_error_mode = "relaxed"


class MLUBackend(Backend):
    name = "mlu"
    hardware_mark = "mlu"

    def op_provider(self) -> OpProvider:
        from corelib_mlu.ops import MluOps

        return MluOps()

    def _probe_native(self) -> Availability:
        try:
            torch_mlu = _import_torch_mlu()
        except Exception as error:  # noqa: BLE001 - ImportError, OSError, RuntimeError alike are reasons
            return Availability(native=False, reason=f"torch_mlu cannot be imported ({one_line(error)})")
        mlu = importlib.import_module("torch_mlu.mlu")
        version = getattr(torch_mlu, "__version__", "unknown version")
        count = int(mlu.device_count())
        if count <= 0:
            return Availability(native=False, reason=f"torch_mlu {version} sees no MLU ({_visible()})")
        narrow = {} if hasattr(mlu, "MLUGraph") else {"graphs": False}
        reason = f"{count} MLU(s), torch_mlu {version} ({_visible()})"
        return Availability(native=True, reason=reason, narrow=narrow)

    def _open_native(self, spec: DeviceSpec) -> Device:
        _import_torch_mlu()
        mlu = importlib.import_module("torch_mlu.mlu")
        count = int(mlu.device_count())
        if not 0 <= spec.device_index < count:
            raise BackendUnavailable(
                f"mlu: backend.device_index={spec.device_index} but {count} MLUs are visible ({_visible()}); "
                "the index counts within the visible devices"
            )
        return MluDevice(spec, mlu, "mlu")
