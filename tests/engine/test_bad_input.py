"""Bad requests fail alone with a reason; a bad engine config fails at start, clearly."""

from __future__ import annotations

import pytest
from support import EngineFactory

from corelib.engine import SamplingParams
from corelib.errors import ConfigError


def test_prompt_too_long_fails_only_that_request(make_engine: EngineFactory) -> None:
    engine = make_engine(["backend=cpu", "model.max_model_len=64"])
    outs = engine.generate([[1] * 64, [2, 3, 4], [5] * 10], SamplingParams(max_tokens=4, ignore_eos=True))
    assert outs[0].finish_reason == "error"
    assert "64 tokens" in (outs[0].error or "") and "max_model_len=64" in (outs[0].error or "")
    assert [len(o.output_token_ids) for o in outs[1:]] == [4, 4]


def test_kv_pool_too_small_for_one_request_is_clear(make_engine: EngineFactory) -> None:
    with pytest.raises(ConfigError, match=r"engine.num_kv_blocks=3 .* needs 32 blocks"):
        make_engine(["backend=cpu", "engine.num_kv_blocks=3"])


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (SamplingParams(temperature=-1.0), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_k=-2), "top_k"),
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(stop_token_ids=(10**6,)), "stop_token_ids"),
    ],
)
def test_invalid_sampling_names_the_field(make_engine: EngineFactory, sampling: SamplingParams, field: str) -> None:
    engine = make_engine(["backend=cpu"])
    bad, good = engine.generate([[1, 2], [3, 4]], [sampling, SamplingParams(max_tokens=2)])
    assert bad.finish_reason == "error" and f"sampling.{field}" in (bad.error or "")
    assert good.finish_reason in ("length", "stop") and good.output_token_ids


def test_out_of_vocabulary_prompt_token(make_engine: EngineFactory) -> None:
    engine = make_engine(["backend=cpu"])
    bad, good = engine.generate([[1, 100000], [3]], SamplingParams(max_tokens=2))
    assert bad.finish_reason == "error" and "outside the vocabulary" in (bad.error or "")
    assert good.output_token_ids


def test_empty_prompt(make_engine: EngineFactory) -> None:
    engine = make_engine(["backend=cpu"])
    (bad,) = engine.generate([[]], SamplingParams(max_tokens=2))
    assert bad.finish_reason == "error" and "empty" in (bad.error or "")
