"""The mlu backend: torch_mlu natively, the stream emulator with the mlu profile otherwise.

Vendor APIs used, all from the Cambricon/torch_mlu repository (package torch_mlu):
- ``torch.mlu.Stream``, ``Event(enable_timing, blocking, interprocess)``: torch_mlu/mlu/streams.py
- ``torch.mlu.MLUGraph``, ``graph(mlu_graph, pool, stream, capture_error_mode="relaxed")``,
  ``graph_pool_handle``: torch_mlu/mlu/graphs.py (relaxed is torch_mlu's default capture mode)
- ``torch.mlu.device_count``, which honours MLU_VISIBLE_DEVICES (and CN_VISIBLE_DEVICES):
  torch_mlu/mlu/__init__.py
torch_mlu binds no host registration (its ``torch.mlu.cnrt()`` module exposes only error
strings and the profiler), so ``host_register`` stays false in mlu.yaml.
The fused ops (torch_mlu_ops kernels) are offered through ``op_provider``: corelib_mlu/ops.py.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

from corelib.backend import DeviceSpec
from corelib.native import TorchDevice, TorchModuleBackend

if TYPE_CHECKING:
    from corelib.ops import OpProvider


class MluDevice(TorchDevice):
    graph_class = "MLUGraph"
    capture_error_mode = "relaxed"


class MLUBackend(TorchModuleBackend):
    name = "mlu"
    hardware_mark = "mlu"
    package = "torch_mlu"
    module_name = "torch_mlu.mlu"
    device_type = "mlu"
    visible_env = "MLU_VISIBLE_DEVICES"
    device_label = "MLU"

    def op_provider(self) -> OpProvider:
        from corelib_mlu.ops import MluOps

        return MluOps()

    def _narrow(self, module: Any) -> dict[str, bool]:
        return {} if hasattr(module, "MLUGraph") else {"graphs": False}

    def _device(self, spec: DeviceSpec, module: ModuleType) -> TorchDevice:
        return MluDevice(spec, module, "mlu")
