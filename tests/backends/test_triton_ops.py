"""The op conformance suite against the cuda backend's Triton ops, in Triton's CPU interpreter.

No GPU is needed: TRITON_INTERPRET=1 runs the kernels on CPU tensors. Triton reads it when it
defines a kernel, its own library's included, so it is set here before Triton is first imported
and stays set for the process (harmless without a GPU: nothing else runs Triton kernels there).
Graph capture needs a device, so those tests skip here; on a GPU this module skips and the
backend conformance suite runs every test natively. The full sweep is marked slow.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("a CUDA device is here: the backend conformance suite runs the Triton ops natively",
                allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton was imported for a GPU earlier in this process", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="Triton is not installed (pip install 'corelib-cuda[triton]')")

from corelib_cpu.device import CpuBackend
from corelib_cuda.backend import CUDABackend
from corelib_cuda.triton_ops import TritonOps
from corelib_cuda.triton_ops.common import INTERPRETER_SM_COUNT
from corelib_cuda.triton_ops.decode_attention import decode_config

from corelib.backend import DeviceSpec
from corelib.device import Capabilities, Runtime
from corelib.ops import OP_NAMES
from corelib.testing.op_cases import DecodeCase
from corelib.testing.op_conformance import *  # noqa: F403
from corelib.testing.op_conformance import DECODE_CASES, DECODE_SWEEP, OpTarget


@pytest.fixture(scope="module")
def op_target() -> OpTarget:
    """The Triton ops loaded for the CPU: the interpreter's "device"; no graphs."""
    provider = TritonOps()
    reason = provider.available()
    if reason is not None:
        pytest.skip(reason)
    device = CpuBackend().open(DeviceSpec(backend="cpu", runtime=Runtime.native, capabilities=Capabilities()))
    return OpTarget(
        provider=provider.name,
        declared=provider.op_names(),
        loaded=provider.load(device),
        torch_device=device.torch_device,
        device=None,
        no_graph_reason="Triton's interpreter runs kernels at once on the CPU: there is no graph to capture",
    )


def test_the_cuda_backend_offers_the_triton_ops() -> None:
    provider = CUDABackend().op_provider()
    assert provider.name == "triton" and provider.op_names() == OP_NAMES


def test_missing_triton_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now raises ImportError
    reason = TritonOps().available()
    assert reason is not None and "corelib-cuda[triton]" in reason and "\n" not in reason


def test_decode_cases_cover_the_split_k_path() -> None:
    # The merge of partial results runs only with several splits: some case must take it.
    def splits(case: DecodeCase) -> int:
        span = case.width * case.block_size
        return decode_config(case.batch, case.kv_heads, case.group, case.head_dim, span, INTERPRETER_SM_COUNT).splits

    assert any(splits(case) > 1 for case in DECODE_CASES)
    assert any(splits(case) == 1 for case in DECODE_CASES)
    assert any(splits(case) > 1 for case in DECODE_SWEEP)
