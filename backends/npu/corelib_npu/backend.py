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

import importlib
import os
from types import ModuleType
from typing import TYPE_CHECKING

from corelib.backend import Backend, DeviceSpec
from corelib.device import Availability, Device, Graph
from corelib.errors import BackendUnavailable, DeviceError, one_line
from corelib.native import TorchDevice
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


def _import_torch_npu() -> ModuleType:
    # corelib switches PyTorch's device-backend autoload off, so torch_npu is imported here,
    # where any failure (no CANN, libhccl.so missing, driver mismatch) becomes a reason.
    return importlib.import_module("torch_npu")


def _visible() -> str:
    return f"{VISIBLE_ENV}={os.environ.get(VISIBLE_ENV)!r}"


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


class NPUBackend(Backend):
    name = "npu"
    hardware_mark = "npu"

    def op_provider(self) -> OpProvider:
        from corelib_npu.ops import NpuOps

        return NpuOps()

    def _probe_native(self) -> Availability:
        try:
            torch_npu = _import_torch_npu()
        except Exception as error:  # noqa: BLE001 - ImportError, OSError, RuntimeError alike are reasons
            return Availability(native=False, reason=f"torch_npu cannot be imported ({one_line(error)})")
        npu = importlib.import_module("torch_npu.npu")
        version = getattr(torch_npu, "__version__", "unknown version")
        count = int(npu.device_count())
        if count <= 0:
            return Availability(native=False, reason=f"torch_npu {version} sees no NPU ({_visible()})")
        narrow: dict[str, bool] = {}
        if not hasattr(npu, "NPUGraph"):
            narrow.update(graphs=False, graph_param_update=False)
        elif not all(hasattr(npu, api) for api in TASK_UPDATE_API):
            narrow["graph_param_update"] = False
        if not hasattr(npu, "npurt"):
            narrow["host_register"] = False
        return Availability(
            native=True, reason=f"{count} NPU(s), torch_npu {version} ({_visible()})", narrow=narrow
        )

    def _open_native(self, spec: DeviceSpec) -> Device:
        _import_torch_npu()
        npu = importlib.import_module("torch_npu.npu")
        count = int(npu.device_count())
        if not 0 <= spec.device_index < count:
            raise BackendUnavailable(
                f"npu: backend.device_index={spec.device_index} but {count} NPUs are visible ({_visible()}); "
                "the index counts within the visible devices"
            )
        return NpuDevice(spec, npu)
