"""The norms' weights folded into the qkv and gate/up weights, as the engine does for an op provider that
declares ``folded_norms``: the same tokens, and only where every layer runs the fused norm ops."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support import local_weights

from corelib.config.options import EngineOptions
from corelib.engine import Engine, SamplingParams
from corelib.models.reference import reference_generate
from corelib.ops import fold_norm_weight

PROMPTS = [[5, 6, 7], list(range(10, 40)), [3, 4, 9, 11]]
MAX_TOKENS = 10
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
BASE = ["backend=cpu", "model.dtype=float32", "engine.max_num_seqs=4"]


def _fold_for_every_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on, as if the backend's provider declared ``folded_norms`` (the cpu backend has none)."""
    decide = EngineOptions.from_startup.__func__  # type: ignore[attr-defined]

    def folding(cls: type[EngineOptions], *args: Any, **kwargs: Any) -> EngineOptions:
        decided: EngineOptions = decide(cls, *args, **kwargs)
        return dataclasses.replace(decided, fold_norms=True)

    monkeypatch.setattr(EngineOptions, "from_startup", classmethod(folding))


def _tokens(*overrides: str) -> tuple[list[list[int]], bool]:
    """Greedy tokens of PROMPTS, and whether the engine's model ran with its norms folded."""
    with Engine.from_overrides([*BASE, *overrides]) as engine:
        outputs = engine.generate(PROMPTS, PARAMS)
        weights = local_weights(engine)
        folded = all(layer.norms_folded for layer in weights.layers)
        for prompt, out in zip(PROMPTS, outputs, strict=True):  # the plain reference reads the folded weights too
            assert out.output_token_ids == reference_generate(weights, prompt, MAX_TOKENS)
        return [o.output_token_ids for o in outputs], folded


def test_folding_keeps_the_linear_of_the_normalized_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    h, norm_weight, weight = torch.randn(3, 64, generator=gen), torch.randn(64, generator=gen), torch.randn(
        32, 64, generator=gen)
    normalized = F.rms_norm(h.double(), (64,), eps=1e-6)
    expected = F.linear(normalized * norm_weight.double(), weight.double())
    folded = fold_norm_weight(weight, norm_weight)
    assert folded.dtype == weight.dtype and folded.data_ptr() != weight.data_ptr()
    torch.testing.assert_close(F.linear(normalized, folded.double()), expected, rtol=1e-6, atol=1e-6)


def test_an_engine_with_its_norms_folded_gives_the_tokens_of_one_without(monkeypatch: pytest.MonkeyPatch) -> None:
    plain, folded = _tokens()
    assert not folded
    _fold_for_every_provider(monkeypatch)
    tokens, folded = _tokens()  # prompts in chunks beside decode rows, then decode steps
    assert folded
    assert tokens == plain


def test_a_model_with_per_head_qk_norms_keeps_its_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its layers run the ops one by one, which take the norms' weights: nothing is folded, the tokens still
    # those of the plain reference (checked in _tokens).
    _fold_for_every_provider(monkeypatch)
    _, folded = _tokens("model.qk_norm=true")
    assert not folded
