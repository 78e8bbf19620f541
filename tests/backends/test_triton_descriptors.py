"""On a GPU with TMA (compute capability 9.0 on), the tensor-core projection kernel with its weight tiles through
tensor descriptors (``Tuning.gemm_tma``, off by default) against the reference; the interpreter runs the same cases
in tests/backends/test_triton_ops.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from support import assert_weights_through_descriptors

from corelib.ops import Ops
from corelib.ops.reference import reference_ops
from corelib.platform.backend import DeviceSpec
from corelib.platform.device import Capabilities, Runtime
from corelib.testing.op_cases import Case
from corelib.testing.projection_cases import DESCRIPTOR_GEMM, DESCRIPTOR_GEMM_IDS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                       reason="needs a CUDA GPU of compute capability 9.0 or newer (TMA)"),
]


@pytest.fixture(scope="module")
def triton_ops() -> Iterator[Ops]:
    pytest.importorskip("triton", reason="Triton is not installed (pip install 'corelib-cuda[triton]')")
    from corelib_cuda.backend import CUDABackend
    from corelib_cuda.triton_ops import TritonOps

    device = CUDABackend().open(DeviceSpec(backend="cuda", runtime=Runtime.native, capabilities=Capabilities()))
    try:
        yield reference_ops().with_provider("triton", TritonOps().load(device))
    finally:
        device.close()


@pytest.mark.parametrize(("op", "case"), DESCRIPTOR_GEMM, ids=DESCRIPTOR_GEMM_IDS)
def test_on_the_gpu_weight_tiles_through_a_descriptor_give_the_reference_results(
    triton_ops: Ops, op: str, case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_weights_through_descriptors(triton_ops, op, case, torch.device("cuda"), monkeypatch)
