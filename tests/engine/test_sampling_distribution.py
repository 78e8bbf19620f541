"""A sampled request draws tokens with the probabilities softmax(logits / temperature) gives them."""

from __future__ import annotations

import math

import pytest
import torch

from corelib.ops import SamplingInputs
from corelib.ops.reference import sample

ROWS = 8000  # one seed per row: the share of each token is within 0.005 of its probability (1 sigma)


def shares(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    sampling = SamplingInputs.of(
        temperature=torch.full((ROWS,), temperature),
        top_k=torch.zeros(ROWS, dtype=torch.int64),
        top_p=torch.ones(ROWS),
        seeds=torch.arange(ROWS, dtype=torch.int64),
        positions=torch.full((ROWS,), 3, dtype=torch.int64),
    )
    tokens = sample(logits.expand(ROWS, -1).contiguous(), sampling)
    return torch.bincount(tokens, minlength=logits.numel()).double() / ROWS


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_sampled_shares_follow_the_softmax(temperature: float) -> None:
    logits = torch.tensor([1.0, 0.0, -1.0, -2.0])
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    seen = shares(logits, temperature)
    sigma = torch.sqrt(expected * (1 - expected) / ROWS)
    worst = float(((seen - expected).abs() / sigma).max())
    assert worst < 5.0, f"shares {seen.tolist()} vs softmax {expected.tolist()} (off by {worst:.1f} sigma)"
    assert math.isclose(float(seen.sum()), 1.0)
