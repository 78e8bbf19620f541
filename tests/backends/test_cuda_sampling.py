"""On a CUDA GPU, the cuda backend's sampler against the reference at a real vocabulary: the processed logits bit
for bit, and the draws' tokens with and without cuts (the noise's logarithm and the temperature's division must
round as torch's CUDA kernels do)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from corelib.ops import SamplingInputs
from corelib.ops.sampling import processed_logits, sample_rows
from corelib.testing.op_cases import SampleCase

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


VOCAB = 151_936  # Qwen's


@pytest.mark.parametrize("case", [SampleCase(64, VOCAB, sampled=True), SampleCase(64, VOCAB, ties=True, sampled=True),
                                  SampleCase(64, VOCAB, uncut=True)], ids=["sampled", "ties", "uncut"])
def test_the_cuda_sampler_gives_the_reference_logits_and_tokens(case: SampleCase) -> None:
    from corelib_cuda.triton_ops import sampling as cuda

    for seed in range(4):
        logits, sampling = case.build(seed, torch.device("cuda"))
        assert isinstance(logits, torch.Tensor) and isinstance(sampling, SamplingInputs)
        assert torch.equal(cuda.processed_logits(logits, sampling), processed_logits(logits, sampling)), seed
        assert torch.equal(cuda.sample(logits, sampling), sample_rows(logits, sampling)), seed
        greedy = dataclasses.replace(sampling, temperature=torch.zeros_like(sampling.temperature), draws=False)
        assert torch.equal(cuda.sample(logits, greedy), sample_rows(logits, greedy)), seed
