"""A max_tokens beyond model.max_model_len: a warning naming the request and both numbers, or a refusal."""

from __future__ import annotations

import logging

import pytest
from support import EngineFactory

from corelib.engine.sequence import SamplingParams

PROMPT = list(range(10, 20))  # 10 tokens


def test_an_overlong_request_is_cut_with_a_warning_naming_it(
    make_engine: EngineFactory, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(["backend=cpu", "engine.max_num_seqs=2", "model.max_model_len=32"])
    with caplog.at_level(logging.WARNING, logger="corelib.engine"):
        long, short = engine.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=100, ignore_eos=True),
                                                         SamplingParams(max_tokens=5, ignore_eos=True)])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"request {long.request_id}: max_tokens=100 with a prompt of 10 tokens exceeds "
                        "model.max_model_len=32; it ends after at most 22 tokens (engine.refuse_overlong=true "
                        "refuses it instead)"]
    assert (long.finish_reason, len(long.output_token_ids)) == ("length", 22)
    assert (short.finish_reason, len(short.output_token_ids)) == ("length", 5)


def test_refuse_overlong_ends_the_request_with_an_error(make_engine: EngineFactory) -> None:
    engine = make_engine(["backend=cpu", "engine.max_num_seqs=2", "model.max_model_len=32",
                          "engine.refuse_overlong=true"])
    long, fits = engine.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=23, ignore_eos=True),
                                                    SamplingParams(max_tokens=22, ignore_eos=True)])
    assert long.finish_reason == "error" and long.output_token_ids == []
    assert long.error == ("max_tokens=23 with a prompt of 10 tokens exceeds model.max_model_len=32; ask for at "
                          "most 22 tokens (engine.refuse_overlong=true)")
    assert (fits.finish_reason, len(fits.output_token_ids)) == ("length", 22)
