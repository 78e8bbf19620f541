"""Both reference RMSNorms compute the written formula, eps included: w * x / sqrt(mean(x^2) + eps).

Values of order 1 hide a missing eps (1e-6 next to a mean square of about 1); these cases make
it dominate: tiny inputs, or an eps as large as the mean square.
"""

from __future__ import annotations

import pytest
import torch

from corelib.models.reference import _rms_norm as model_rms_norm
from corelib.ops.reference import rms_norm as op_rms_norm

CASES = [
    pytest.param(1e-3, 1e-6, id="tiny-inputs"),
    pytest.param(1.0, 1.0, id="large-eps"),
    pytest.param(0.05, 1e-2, id="both"),
]


def written(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.double()
    return (weight.double() * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def inputs(scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = scale * torch.randn(5, 64, generator=generator)
    weight = 1.0 + 0.1 * torch.randn(64, generator=generator)
    return x, weight


@pytest.mark.parametrize(("scale", "eps"), CASES)
def test_the_reference_op_follows_the_formula(scale: float, eps: float) -> None:
    x, weight = inputs(scale)
    out, residual = op_rms_norm(x, weight, eps)
    torch.testing.assert_close(out, written(x, weight, eps), rtol=1e-5, atol=1e-6)
    assert torch.equal(residual, x)


@pytest.mark.parametrize(("scale", "eps"), CASES)
def test_the_reference_op_adds_the_residual_first(scale: float, eps: float) -> None:
    x, weight = inputs(scale)
    residual = torch.full_like(x, scale)
    out, stream = op_rms_norm(x, weight, eps, residual)
    torch.testing.assert_close(stream, x + residual)
    torch.testing.assert_close(out, written(x + residual, weight, eps), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("scale", "eps"), CASES)
def test_the_plain_reference_model_follows_the_formula(scale: float, eps: float) -> None:
    x, weight = inputs(scale)
    torch.testing.assert_close(model_rms_norm(x, weight, eps), written(x, weight, eps), rtol=1e-5, atol=1e-6)
