"""Bad requests fail alone with a reason; a bad engine config fails at start, clearly."""

from __future__ import annotations

import numpy as np
import pytest
from support import EngineFactory

from corelib.engine import SamplingParams
from corelib.errors import ConfigError
from corelib.sampling_params import SamplingError


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
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 3.5e38}, "temperature"),  # beyond float32, the column's dtype
        ({"temperature": 1e308}, "temperature"),
        ({"top_k": 2**63}, "top_k"),  # beyond int64
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"n": 0}, "n"),
    ],
)
def test_invalid_sampling_is_refused_at_construction_naming_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(SamplingError) as refused:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert refused.value.field == field and str(refused.value).startswith(f"{field}=")
    assert isinstance(refused.value, ValueError) and "\n" not in str(refused.value)


def test_a_stop_token_outside_the_vocabulary_fails_that_request_alone(make_engine: EngineFactory) -> None:
    engine = make_engine(["backend=cpu"])
    outside = SamplingParams(stop_token_ids=(10**6,))
    bad, good = engine.generate([[1, 2], [3, 4]], [outside, SamplingParams(max_tokens=2)])
    assert bad.finish_reason == "error" and "stop_token_ids" in (bad.error or "")
    assert good.finish_reason in ("length", "stop") and good.output_token_ids


def test_numpy_numbers_sample_as_the_numbers_they_are(make_engine: EngineFactory) -> None:
    engine = make_engine(["backend=npu", "engine.async_token_handoff=on"])
    plain = SamplingParams(max_tokens=6, temperature=0.5, top_k=5, top_p=0.75, seed=3, ignore_eos=True)
    numpy_values: dict[str, object] = {"max_tokens": np.int64(6), "temperature": np.float32(0.5), "top_k": np.int64(5),
                                       "top_p": np.float64(0.75), "seed": np.int32(3), "stop_token_ids": [np.int64(0)]}
    typed = SamplingParams(**numpy_values, ignore_eos=True)  # type: ignore[arg-type]
    assert typed == plain.replace(stop_token_ids=(0,))
    assert all(type(getattr(typed, name)) in (int, float) for name in ("max_tokens", "temperature", "top_k", "seed"))
    want, got = engine.generate([[3, 4, 5], [3, 4, 5]], [plain, typed])
    assert got.output_token_ids == want.output_token_ids and len(got.output_token_ids) == 6
    assert engine.generate([[3, 4]], SamplingParams(max_tokens=2))[0].finish_reason == "length", "the engine stopped"


def test_out_of_vocabulary_prompt_token(make_engine: EngineFactory) -> None:
    engine = make_engine(["backend=cpu"])
    bad, good = engine.generate([[1, 100000], [3]], SamplingParams(max_tokens=2))
    assert bad.finish_reason == "error" and "outside the vocabulary" in (bad.error or "")
    assert good.output_token_ids


def test_empty_prompt(make_engine: EngineFactory) -> None:
    engine = make_engine(["backend=cpu"])
    (bad,) = engine.generate([[]], SamplingParams(max_tokens=2))
    assert bad.finish_reason == "error" and "empty" in (bad.error or "")
