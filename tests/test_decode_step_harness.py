"""benchmarks/decode_step.py: the step harness folds the norms' weights as the engine does when asked."""

from __future__ import annotations

import torch
from corelib_cpu.device import CpuBackend
from support import load_benchmark

from corelib.platform.backend import DeviceSpec
from corelib.platform.device import Capabilities, Runtime


def test_the_harness_folds_the_norms_into_the_projections_only_when_asked() -> None:
    decode_step = load_benchmark("decode_step")
    device = CpuBackend().open(DeviceSpec(backend="cpu", runtime=Runtime.native, capabilities=Capabilities()))
    plain = decode_step.load("tiny", "float32", device)
    folded = decode_step.load("tiny", "float32", device, fold_norms=True)
    for before, after in zip(plain.weights.layers, folded.weights.layers, strict=True):
        assert not before.norms_folded and after.norms_folded
        # the same random weights (seeded), the input norm's weight multiplied into qkv's columns
        torch.testing.assert_close(after.qkv, (before.qkv.float() * before.input_norm.float()).to(before.qkv.dtype))
