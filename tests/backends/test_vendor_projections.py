"""The projections and the fused decode-layer ops on the npu and mlu providers, through the stand-ins.

``linear`` (and on the MLU ``linear_residual``) map to a vendor matmul; the other fused ops have
no single vendor operator, so the op container composes them from the provider's ops: each test
checks which vendor functions a composed op runs, with which arguments, and that it equals the
reference composition.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vendorkit import FakeTmo, FakeTorchNpu, Op, close, install_mlu, install_npu

from corelib.ops import Ops
from corelib.ops.reference import reference_ops
from corelib.testing.projection_cases import NormGateUpCase, NormLogitsCase, NormQkvCase


@pytest.fixture
def npu(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeTorchNpu, dict[str, Op]]:
    return install_npu(monkeypatch)


@pytest.fixture
def mlu(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeTmo, dict[str, Op]]:
    return install_mlu(monkeypatch)


REFERENCE = reference_ops()
CPU = torch.device("cpu")


def _with(provider: str, ops: dict[str, Op]) -> Ops:
    return REFERENCE.with_provider(provider, ops)


def test_npu_linear_maps_to_npu_linear_for_the_dtypes_it_lists(npu: tuple[FakeTorchNpu, dict[str, Op]]) -> None:
    fake, ops = npu
    for dtype in (torch.float32, torch.float16):
        x, weight, bias = torch.randn(3, 5, 64).to(dtype), torch.randn(48, 64).to(dtype), torch.randn(48).to(dtype)
        close(ops["linear"](x, weight, bias), REFERENCE.linear(x.float(), weight.float(), bias.float()))
    calls = fake.named("npu_linear")
    assert len(calls) == 2 and calls[0]["input"].shape == (15, 64) and calls[0]["weight"] is not None


def test_npu_linear_keeps_bfloat16_on_torchs_matmul(npu: tuple[FakeTorchNpu, dict[str, Op]]) -> None:
    fake, ops = npu
    x, weight = torch.randn(3, 64).bfloat16(), torch.randn(48, 64).bfloat16()
    assert torch.equal(ops["linear"](x, weight), REFERENCE.linear(x, weight))
    assert not fake.named("npu_linear"), "npu_linear does not list bfloat16"


def test_npu_composes_the_decode_layer_ops_from_its_vendor_functions(npu: tuple[FakeTorchNpu, dict[str, Op]]) -> None:
    fake, ops = npu
    composed = _with("torch_npu", ops)
    assert composed.providers["norm_gate_up_silu_mul"] == "composed" and "linear" in composed.fused
    gate_up_args: tuple[Any, ...] = NormGateUpCase(torch.float16, 3, 64, 40).build(0, CPU)
    h, nw, eps, gate_up = gate_up_args
    close(composed.norm_gate_up_silu_mul(h, nw, eps, gate_up), REFERENCE.norm_gate_up_silu_mul(h, nw, eps, gate_up))
    assert [name for name, _ in fake.calls] == ["npu_rms_norm", "npu_linear", "npu_swiglu"]
    fake.calls.clear()
    logits_args: tuple[Any, ...] = NormLogitsCase(torch.float32, 2, 64, 300).build(0, CPU)
    h, nw, eps, head = logits_args
    close(composed.norm_logits(h, nw, eps, head), REFERENCE.norm_logits(h, nw, eps, head))
    assert [name for name, _ in fake.calls] == ["npu_rms_norm", "npu_linear"]
    fake.calls.clear()
    args: tuple[Any, ...] = NormQkvCase(torch.float32, 3, 4, 64, 16, hidden=128).build(0, CPU)
    expected_args: tuple[Any, ...] = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    q = composed.norm_qkv_rope_kv_write(*args)
    close(q, REFERENCE.norm_qkv_rope_kv_write(*expected_args))
    close(args[7], expected_args[7])  # the keys written into the cache
    assert [name for name, _ in fake.calls] == ["npu_rms_norm", "npu_linear", "npu_rotary_mul",
                                                "npu_scatter_nd_update_", "npu_scatter_nd_update_"]


def test_mlu_linear_and_linear_residual_map_to_matmul_with_its_epilogue(mlu: tuple[FakeTmo, dict[str, Op]]) -> None:
    fake, ops = mlu
    x, weight, bias = torch.randn(4, 64).bfloat16(), torch.randn(48, 64).bfloat16(), torch.randn(48).bfloat16()
    residual = torch.randn(4, 48).bfloat16()
    close(ops["linear"](x, weight, bias), REFERENCE.linear(x, weight, bias))
    close(ops["linear_residual"](x, weight, residual), REFERENCE.linear_residual(x, weight, residual))
    plain, fused = fake.named("matmul")
    assert plain["trans_b"] and plain["bias"] is bias and plain["residual"] is None and plain["beta"] == 0.0
    assert fused["trans_b"] and fused["residual"].shape == (4, 48) and (fused["alpha"], fused["beta"]) == (1.0, 1.0)
    assert plain["act_mode"] == fused["act_mode"] == "none"


def test_mlu_composes_norm_gate_up_from_fused_rms_norm_matmul_and_active(mlu: tuple[FakeTmo, dict[str, Op]]) -> None:
    fake, ops = mlu
    composed = _with("torch_mlu_ops", ops)
    case_args: tuple[Any, ...] = NormGateUpCase(torch.bfloat16, 5, 64, 40).build(0, CPU)
    h, nw, eps, gate_up = case_args
    close(composed.norm_gate_up_silu_mul(h, nw, eps, gate_up), REFERENCE.norm_gate_up_silu_mul(h, nw, eps, gate_up))
    assert [name for name, _ in fake.calls] == ["fused_rms_norm", "matmul", "active"]
    assert composed.providers["linear_residual"] == "torch_mlu_ops", "the MLU fuses the residual into its matmul"
