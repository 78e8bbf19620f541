"""The cuda backend: torch.cuda natively, the stream emulator with the cuda profile otherwise."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from corelib.backend import DeviceSpec
from corelib.errors import DeviceError, one_line
from corelib.native import TorchDevice, TorchModuleBackend
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


def symmetric_memory_missing() -> str | None:
    """Why this torch cannot all-reduce through symmetric memory (None: it can), without touching a GPU.

    corelib.transport.parallel.SymmetricAllReduce needs ``torch.distributed._symmetric_memory``
    (``empty``, ``rendezvous``) and the one-shot and two-shot ops, compiled for CUDA.
    """
    if not torch.distributed.is_available():
        return "torch was built without torch.distributed"
    if torch.version.cuda is None:
        return "torch is not a CUDA build"
    try:
        symm_mem = importlib.import_module("torch.distributed._symmetric_memory")
    except Exception as error:  # noqa: BLE001 - any import failure is the reason
        return f"torch.distributed._symmetric_memory cannot be imported ({one_line(error)})"
    missing = [name for name in ("empty", "rendezvous") if not hasattr(symm_mem, name)]
    ops = getattr(torch.ops, "symm_mem", None)
    missing += [f"torch.ops.symm_mem.{name}" for name in ("one_shot_all_reduce_out", "two_shot_all_reduce_")
                if not _has_op(ops, name)]
    return f"torch {torch.__version__} lacks {', '.join(missing)}" if missing else None


def _has_op(namespace: object, name: str) -> bool:
    try:
        return getattr(namespace, name, None) is not None
    except (AttributeError, RuntimeError):  # an op namespace raises for a name it does not hold
        return False


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


class CUDABackend(TorchModuleBackend):
    name = "cuda"
    hardware_mark = "gpu"
    package = "torch"
    module_name = "torch.cuda"
    device_type = "cuda"
    visible_env = "CUDA_VISIBLE_DEVICES"
    device_label = "CUDA device"

    def _describe(self, module: Any, count: int) -> str:
        return f"{count} x {module.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"

    def _narrow(self, module: Any) -> dict[str, bool]:
        """Without torch's symmetric memory, tensor parallelism keeps NCCL for every all-reduce; PDL
        needs compute capability 9.0 (Hopper) and a Triton that launches and waits that way."""
        narrow = {} if symmetric_memory_missing() is None else {"symmetric_memory": False}
        if tuple(module.get_device_capability(0)) < (9, 0):
            narrow["programmatic_launch"] = False
        if TritonOps().pdl_missing() is not None:
            narrow["programmatic_launch_kernels"] = False
        return narrow

    def op_provider(self) -> OpProvider:
        """The Triton kernels (an optional extra: its ``available()`` says when Triton is missing)."""
        return TritonOps()

    def _device(self, spec: DeviceSpec, module: ModuleType) -> TorchDevice:
        return CudaDevice(spec, module, "cuda")
