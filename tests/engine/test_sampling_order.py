"""Top-p cuts the distribution the request samples from: temperature first, then top-k, then top-p.

Hugging Face (``TemperatureLogitsWarper`` before ``TopKLogitsWarper`` before ``TopPLogitsWarper``)
and vLLM apply the temperature before the cuts. Away from temperature 1 the order decides which
tokens stay: the logits below are chosen so that a cut on the unscaled distribution keeps a
different set than a cut on the scaled one.
"""

from __future__ import annotations

import pytest
import torch

from corelib.ops import SamplingInputs
from corelib.ops.reference import sample as reference_sample
from corelib.ops.sampling import sample_rows

ROWS = 400  # one row per seed: every row draws its own noise
# softmax([2, 1, 0]) = [0.665, 0.245, 0.090]; the tail is far below every cut used here.
LOGITS = torch.tensor([2.0, 1.0, 0.0, -12.0, -12.0, -12.0, -12.0, -12.0])


def draws(sampler: str, temperature: float, top_p: float, top_k: int = 0, logits: torch.Tensor = LOGITS) -> set[int]:
    """The tokens drawn by ROWS rows of the same logits, each with its own seed."""
    sampling = SamplingInputs.of(
        temperature=torch.full((ROWS,), temperature),
        top_k=torch.full((ROWS,), top_k, dtype=torch.int64),
        top_p=torch.full((ROWS,), top_p),
        seeds=torch.arange(ROWS, dtype=torch.int64),
        positions=torch.full((ROWS,), 7, dtype=torch.int64),
    )
    rows = logits.expand(ROWS, -1).contiguous()
    tokens = reference_sample(rows, sampling) if sampler == "reference" else sample_rows(rows, sampling)
    return set(tokens.tolist())


SAMPLERS = ["reference", "sample_rows"]


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_a_hot_temperature_widens_the_nucleus_before_the_cut(sampler: str) -> None:
    # temperature 2: softmax([1, .5, 0]) = [0.506, 0.307, 0.186]; mass above token 1 is 0.506 < 0.6,
    # so tokens 0 and 1 stay. Cut before scaling, the mass above token 1 would be 0.665: only token 0.
    assert draws(sampler, temperature=2.0, top_p=0.6) == {0, 1}


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_a_cold_temperature_narrows_the_nucleus_before_the_cut(sampler: str) -> None:
    # Two close leaders over a long tail. temperature 0.25: softmax = [0.690, 0.310, ~0, ...]; the
    # mass above token 1 is 0.690 >= 0.5, so only token 0 stays. Cut before scaling, the tail holds
    # most of the mass (softmax = [0.204, 0.167, 0.010 x 62]): token 1 and some of the tail would
    # stay, and token 1, 0.8 below token 0 once scaled, would be drawn often.
    logits = torch.tensor([0.0, -0.2] + [-3.0] * 62)
    assert draws(sampler, temperature=0.25, top_p=0.5, logits=logits) == {0}


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_top_k_cuts_before_top_p_renormalises(sampler: str) -> None:
    # top_k=2 leaves [2, 1] at temperature 2: softmax([1, .5]) = [0.622, 0.378]. The mass above
    # token 1 is 0.622 >= 0.6, so top-p keeps token 0 alone; top-p over the whole vocabulary
    # (0.506 above token 1) would have kept token 1 too.
    assert draws(sampler, temperature=2.0, top_p=0.6, top_k=2) == {0}
