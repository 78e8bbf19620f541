"""The npu backend: torch_npu natively, the stream emulator with the npu profile otherwise.

Vendor APIs used, all from the Ascend/pytorch repository (package torch_npu):
- ``torch_npu.npu.Stream``, ``Event``, ``ExternalEvent``: torch_npu/npu/streams.py
- ``torch_npu.npu.NPUGraph``, ``graph(npu_graph, pool, stream, capture_error_mode)``,
  ``graph_pool_handle``, ``graph_task_group_begin/end``, ``graph_task_update_begin/end``:
  torch_npu/npu/graphs.py
- ``torch_npu.npu.npurt().npuHostRegister/npuHostUnregister`` (aclrtHostRegisterV2 /
  aclrtHostUnregister, returning the aclError): torch_npu/npu/__init__.py,
  torch_npu/csrc/npu/npurt.cpp
- ``torch_npu.npu.device_count``, which honours ASCEND_RT_VISIBLE_DEVICES: torch_npu/npu/__init__.py
The fused ops (torch_npu's npu_* kernels) are offered through ``op_provider``: corelib_npu/ops.py.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

from corelib.backend import DeviceSpec
from corelib.errors import DeviceError
from corelib.graph import Graph
from corelib.native import TorchDevice, TorchModuleBackend
from corelib_npu.graph import TASK_UPDATE_API, NpuGraph

if TYPE_CHECKING:
    from corelib.ops import OpProvider

VISIBLE_ENV = "ASCEND_RT_VISIBLE_DEVICES"
# aclrtHostRegisterV2 flags (CANN acl_rt.h, as used in torch_npu's npurt tests): MAPPED keeps
# full DMA bandwidth but needs 4 KiB alignment; PINNED works on any address.
_ACL_HOST_REG_MAPPED = 0x2
_ACL_HOST_REG_PINNED = 0x10000000
_PAGE = 4096
# Codes npuHostRegister returns (acl_base.h, rt_error_codes.h).
_ERROR_NAMES = {
    100000: "ACL_ERROR_INVALID_PARAM",
    107000: "ACL_ERROR_RT_PARAM_INVALID",
    107008: "ACL_ERROR_RT_ADDR_UNALIGNED",
    207000: "ACL_ERROR_RT_FEATURE_NOT_SUPPORT",
}


def check(status: object, call: str) -> None:
    """Raise a DeviceError naming the ACL error when an npurt call did not succeed."""
    code = int(status)  # type: ignore[call-overload]
    if code != 0:
        raise DeviceError(f"npu: {call} failed with {_ERROR_NAMES.get(code, f'aclError {code}')}")


class NpuDevice(TorchDevice):
    graph_class = "NPUGraph"

    def __init__(self, spec: DeviceSpec, module: ModuleType) -> None:
        super().__init__(spec, module, "npu")
        self._update_stream: object | None = None

    def update_stream(self) -> object:
        """A stream for graph task updates: torch_npu requires it to differ from the capture stream."""
        if self._update_stream is None:
            self._update_stream = self.module.Stream(device=self.index)
        return self._update_stream

    def _graph(self, name: str) -> Graph:
        return NpuGraph(self, name)

    def _pin(self, ptr: int, nbytes: int) -> None:
        aligned = ptr % _PAGE == 0 and nbytes % _PAGE == 0
        flags = _ACL_HOST_REG_MAPPED if aligned else _ACL_HOST_REG_PINNED
        check(self.module.npurt().npuHostRegister(ptr, nbytes, flags), "npuHostRegister")

    def _unpin(self, ptr: int) -> None:
        check(self.module.npurt().npuHostUnregister(ptr), "npuHostUnregister")


class NPUBackend(TorchModuleBackend):
    name = "npu"
    hardware_mark = "npu"
    package = "torch_npu"  # corelib switches PyTorch's device-backend autoload off: imported here
    module_name = "torch_npu.npu"
    device_type = "npu"
    visible_env = VISIBLE_ENV
    device_label = "NPU"

    def op_provider(self) -> OpProvider:
        from corelib_npu.ops import NpuOps

        return NpuOps()

    def _narrow(self, module: Any) -> dict[str, bool]:
        narrow: dict[str, bool] = {}
        if not hasattr(module, "NPUGraph"):
            narrow.update(graphs=False, graph_param_update=False)
        elif not all(hasattr(module, api) for api in TASK_UPDATE_API):
            narrow["graph_param_update"] = False
        if not hasattr(module, "npurt"):
            narrow["host_register"] = False
        return narrow

    def _device(self, spec: DeviceSpec, module: ModuleType) -> TorchDevice:
        return NpuDevice(spec, module)
