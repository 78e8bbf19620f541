"""A drawing row takes the argmax of its scaled logits plus noise over the tokens its cuts keep. A step where no
row has a cut (top-k, top-p below 1, min_p) sorts nothing: the noise and an argmax over the vocabulary, the
tokens the sorted path gives such rows. (Which captured variant a step replays: test_sampler_argmax.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support import counted_sorts

from corelib.ops import SamplingInputs
from corelib.ops.sampling import cut_thresholds, gumbel_noise, sample_rows, uniform_of


def test_the_noise_is_finite_for_every_hash() -> None:
    extremes = torch.tensor([0, -1, -(1 << 63), (1 << 63) - 1, (1 << 40) - 1])  # int64 bit patterns
    uniform = uniform_of(extremes)
    assert bool(((uniform > 0) & (uniform < 1)).all()), uniform
    assert bool(torch.isfinite(-torch.log(-torch.log(uniform))).all())
    noise = gumbel_noise(torch.tensor([3]), torch.tensor([5]), torch.arange(1 << 16)[None, :])
    assert bool(torch.isfinite(noise).all())


def drawn(rows: int, seed: int, **columns: object) -> tuple[torch.Tensor, SamplingInputs]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, 500, generator=gen) * 3
    logits[:, :40] = logits[:, :40].round()  # equal values near the top: the ties decide
    sampling = SamplingInputs.of(torch.arange(rows) + 7 * seed, seeds=torch.arange(rows) * 11 + seed,
                                 temperature=torch.rand(rows, generator=gen) * 1.5, **columns)  # type: ignore[arg-type]
    return logits, sampling


def test_rows_without_cuts_draw_the_same_tokens_with_and_without_the_sort() -> None:
    for seed in range(6):
        logits, sampling = drawn(32, seed)
        unsorted = sample_rows(logits, dataclasses.replace(sampling, cuts=False))
        assert torch.equal(sample_rows(logits, sampling), unsorted)
        assert not torch.equal(unsorted, logits.argmax(dim=-1)), "the rows draw"


def test_without_cuts_nothing_sorts_the_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    logits, sampling = drawn(4, 0)
    sorts = counted_sorts(monkeypatch)
    sample_rows(logits, dataclasses.replace(sampling, cuts=False))
    assert sorts == []
    sample_rows(logits, sampling)
    assert sorts == [500]


def test_top_p_one_cuts_nothing_where_the_mass_rounds_to_one_early() -> None:
    # The top token holds all but 1e-13 of the mass: the float cumulative sum is 1.0 from the second token on.
    logits = torch.zeros(1, 100)
    logits[0, 5] = 30.0
    sampling = SamplingInputs.of(torch.tensor([0]), temperature=[1.0], top_p=[1.0])
    value, last = cut_thresholds(logits, sampling)
    assert (value.item(), last.item()) == (0.0, 99), "every token kept: the last is the largest id of the smallest"
    value, last = cut_thresholds(logits, dataclasses.replace(sampling, top_p=torch.tensor([0.999])))
    assert (value.item(), last.item()) == (30.0, 5)


def test_ties_at_the_top_k_boundary_keep_the_lowest_ids() -> None:
    logits = torch.zeros(64, 50)  # every token equally likely
    sampling = SamplingInputs.of(torch.arange(64), seeds=torch.arange(64), temperature=[1.0] * 64, top_k=[3] * 64)
    assert set(sample_rows(logits, sampling).tolist()) == {0, 1, 2}
