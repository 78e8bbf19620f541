"""What every Triton op shares: the interpreter switch, block-size rules and one-line input checks."""

from __future__ import annotations

import functools
import os

import torch

#: float dtypes the kernels take (the model dtypes)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: multiprocessors assumed when there is no GPU (the interpreter): small, so split-K shows up in tests
INTERPRETER_SM_COUNT = 4


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU in its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.lru_cache(maxsize=16)
def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device``; a grid sized from it stays the same for a captured graph."""
    if device.type != "cuda":
        return INTERPRETER_SM_COUNT
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def check(condition: bool, op: str, message: str) -> None:
    """Raise a one-line ValueError naming the op when a caller's input breaks its contract."""
    if not condition:
        raise ValueError(f"{op}: {message}")


def check_float(op: str, **tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        check(tensor.dtype in FLOAT_DTYPES, op, f"{name} is {tensor.dtype}; expected float32, bfloat16 or float16")


def last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The kernels index rows by stride but read each row as one contiguous run."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs multiply in full precision (no TF32), to match the float32 reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_in_kernel() -> bool:
    """Whether kernels convert half-precision inputs to float32 before ``tl.dot``.

    Triton's CPU interpreter computes bfloat16 arithmetic on its raw bits, so there every value
    goes through float32; on a GPU the tensor cores take bfloat16/float16 directly.
    """
    return interpreting()
