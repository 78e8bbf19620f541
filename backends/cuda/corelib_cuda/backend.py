"""The cuda backend: torch.cuda natively, the stream emulator with the cuda profile otherwise."""

from __future__ import annotations

import os
from typing import Any

import torch

from corelib.backend import Backend, DeviceSpec
from corelib.device import Availability, Device
from corelib.errors import BackendUnavailable, DeviceError
from corelib.native import TorchDevice
from corelib.ops import OpProvider
from corelib_cuda.triton_ops import TritonOps

# cudaHostRegisterDefault: page-lock in place, no mapping into the device address space.
_HOST_REGISTER_DEFAULT = 0
# Names of the codes cudaHostRegister/Unregister return (driver_types.h); torch binds only
# cudaGetErrorString, which gives the sentence but not the name.
_ERROR_NAMES = {
    1: "cudaErrorInvalidValue",
    2: "cudaErrorMemoryAllocation",
    3: "cudaErrorInitializationError",
    712: "cudaErrorHostMemoryAlreadyRegistered",
    713: "cudaErrorHostMemoryNotRegistered",
    801: "cudaErrorNotSupported",
}


def _cudart() -> Any:
    # torch.cuda.cudart() binds cudaHostRegister, cudaHostUnregister and cudaGetErrorString
    # (torch/csrc/cuda/shared/cudart.cpp); each call returns the cudaError code.
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def check(status: object, call: str) -> None:
    """Raise a DeviceError naming the CUDA error when a cudart call did not succeed."""
    code = int(status)  # type: ignore[call-overload]
    if code == 0:
        return
    cudart = _cudart()
    text = cudart.cudaGetErrorString(cudart.cudaError(code))
    raise DeviceError(f"cuda: {call} failed with {_ERROR_NAMES.get(code, f'CUDA error {code}')}: {text}")


class CudaDevice(TorchDevice):
    graph_class = "CUDAGraph"  # torch.cuda.CUDAGraph, captured through torch.cuda.graph

    def _pin(self, ptr: int, nbytes: int) -> None:
        check(_cudart().cudaHostRegister(ptr, nbytes, _HOST_REGISTER_DEFAULT), "cudaHostRegister")

    def _unpin(self, ptr: int) -> None:
        check(_cudart().cudaHostUnregister(ptr), "cudaHostUnregister")


class CUDABackend(Backend):
    name = "cuda"
    hardware_mark = "gpu"

    def _probe_native(self) -> Availability:
        if not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            return Availability(native=False, reason=f"torch {torch.__version__} sees no CUDA device{where}")
        count, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
        return Availability(
            native=True, reason=f"{count} x {name}, torch {torch.__version__}, CUDA {torch.version.cuda}"
        )

    def op_provider(self) -> OpProvider:
        """The Triton kernels (an optional extra: its ``available()`` says when Triton is missing)."""
        return TritonOps()

    def _open_native(self, spec: DeviceSpec) -> Device:
        count = torch.cuda.device_count()
        if not 0 <= spec.device_index < count:
            raise BackendUnavailable(
                f"cuda: backend.device_index={spec.device_index} but {count} CUDA devices are visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
            )
        return CudaDevice(spec, torch.cuda, "cuda")
