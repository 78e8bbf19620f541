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


def test_on_the_gpu_a_row_holding_nan_still_samples_a_valid_token_id() -> None:
    from corelib_cuda.triton_ops import sampling as cuda

    logits = torch.randn(4, VOCAB, device="cuda")
    logits[1, 7] = float("nan")
    logits[2] = float("nan")
    drawn = SamplingInputs.of(torch.arange(4, device="cuda"), seeds=[1, 2, 3, 4], temperature=[0.0, 1.0, 1.0, 0.0])
    for sampling in (None, drawn, dataclasses.replace(drawn, cuts=False)):
        tokens = cuda.sample(logits, sampling)
        assert bool(((tokens >= 0) & (tokens < VOCAB)).all()), tokens
