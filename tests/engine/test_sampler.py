"""Device sampling: greedy is argmax, seeded sampling is reproducible and respects top-k / top-p."""

from __future__ import annotations

import torch

from corelib.ops import SamplingInputs
from corelib.ops.reference import sample as reference_sample
from corelib.ops.sampling import gumbel_noise


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return reference_sample(logits, None)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    sampling = SamplingInputs.of(positions, temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds)
    return reference_sample(logits, sampling)


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0], [5.0, 0.0, 4.9]])
    assert greedy(logits).tolist() == [1, 0]


def _sample(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
            position: int = 0) -> int:
    b = logits.shape[0]
    return int(
        sample(
            logits,
            torch.full((b,), temperature),
            torch.full((b,), top_k, dtype=torch.int64),
            torch.full((b,), top_p),
            torch.full((b,), seed, dtype=torch.int64),
            torch.full((b,), position, dtype=torch.int64),
        )[0]
    )


def test_zero_temperature_rows_are_greedy() -> None:
    logits = torch.randn(1, 50)
    assert _sample(logits, 0.0) == int(logits.argmax())


def test_same_seed_same_token_different_seeds_differ() -> None:
    logits = torch.zeros(1, 1000)
    draws = {_sample(logits, 1.0, seed=s) for s in range(20)}
    assert len(draws) > 10
    assert _sample(logits, 1.0, seed=3, position=7) == _sample(logits, 1.0, seed=3, position=7)


def test_sampling_does_not_depend_on_batch_neighbours() -> None:
    logits = torch.randn(4, 64)
    temperature = torch.ones(4)
    top_k = torch.zeros(4, dtype=torch.int64)
    top_p = torch.ones(4)
    seeds = torch.tensor([1, 2, 3, 4])
    pos = torch.tensor([5, 5, 5, 5])
    full = sample(logits, temperature, top_k, top_p, seeds, pos)
    alone = sample(logits[2:3], temperature[:1], top_k[:1], top_p[:1], seeds[2:3], pos[:1])
    assert int(full[2]) == int(alone[0])


def test_top_k_one_is_greedy_and_top_k_limits_support() -> None:
    logits = torch.randn(1, 100)
    assert _sample(logits, 2.0, top_k=1, seed=9) == int(logits.argmax())
    top3 = set(logits[0].topk(3).indices.tolist())
    assert {_sample(logits, 5.0, top_k=3, seed=s) for s in range(40)} <= top3


def test_top_p_keeps_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05]]))
    seen = {_sample(logits, 1.0, top_p=0.7, seed=s) for s in range(200)}
    assert seen == {0, 1}


def test_gumbel_noise_is_finite() -> None:
    noise = gumbel_noise(torch.arange(8), torch.arange(8), torch.arange(8 * 100).view(8, 100))
    assert torch.isfinite(noise).all()
