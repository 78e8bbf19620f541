"""The batched, paged (graph-captured where possible) greedy path gives the reference's tokens."""

from __future__ import annotations

import pytest
import torch
from support import EngineFactory, local_weights

from corelib.engine import Engine, SamplingParams
from corelib.models.reference import reference_generate

PROMPTS = [[5, 6, 7], list(range(10, 40)), [100] * 5, list(range(200, 217)), [3, 4], list(range(300, 301))]
MAX_TOKENS = [20, 33, 5, 1, 40, 12]


def check_against_reference(make_engine: EngineFactory, overrides: list[str]) -> Engine:
    engine = make_engine(overrides)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = engine.generate(PROMPTS, params)
    for prompt, n, out in zip(PROMPTS, MAX_TOKENS, outputs, strict=True):
        expected = reference_generate(local_weights(engine), prompt, n)
        assert out.output_token_ids == expected, (f"prompt {prompt[:4]}...: engine and reference disagree "
                                                  f"(finish reason {out.finish_reason}, error {out.error!r})")
        assert out.finish_reason == "length"
    return engine


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "hybrid-tiny"])
def test_cpu_matches_reference(make_engine: EngineFactory, model: str) -> None:
    check_against_reference(make_engine, ["backend=cpu", f"model={model}"])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_architecture_flags_match_reference(make_engine: EngineFactory, arch: str) -> None:
    check_against_reference(make_engine, ["backend=cpu", f"model.architecture={arch}"])


def test_preemption_keeps_tokens_exact(make_engine: EngineFactory) -> None:
    overrides = ["backend=cpu", "engine.max_num_seqs=4", "engine.num_kv_blocks=6", "model.max_model_len=80"]
    engine = check_against_reference(make_engine, overrides)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for all requests at once"


def test_eos_stops_the_request(make_engine: EngineFactory) -> None:
    probe = make_engine(["backend=cpu"])
    prompt = [9, 8, 7, 6]
    free_run = reference_generate(local_weights(probe), prompt, 12)
    eos = free_run[5]
    engine = make_engine(["backend=cpu", f"model.eos_token_id={eos}"])
    out = engine.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert out.output_token_ids == free_run[: free_run.index(eos) + 1]
    assert out.finish_reason == "stop"


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(["backend=npu", "backend.emulator.chaos=0.3"], id="npu-emulated-chaos"),
        pytest.param(["backend=cuda", "backend.runtime=emulated", "backend.emulator.chaos=0.3"],
                     id="cuda-emulated-chaos"),
        pytest.param(["backend=cuda", "backend.runtime=native"], id="cuda-native",
                     marks=[pytest.mark.gpu,
                            pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]),
        pytest.param(["backend=cuda", "backend.runtime=native", "model.hidden_size=512", "model.num_layers=6",
                      "model.num_heads=8", "model.num_kv_heads=4", "model.intermediate_size=1536"],
                     id="cuda-native-wider",
                     marks=[pytest.mark.gpu,
                            pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]),
    ],
)
@pytest.mark.parametrize("handoff", ["off", "on"])
@pytest.mark.slow
def test_graphs_and_handoff_match_reference(make_engine: EngineFactory, overrides: list[str], handoff: str) -> None:
    engine = check_against_reference(make_engine, [*overrides, f"engine.async_token_handoff={handoff}"])
    assert engine.metrics(1.0)["graph_steps"] > 0, "decode steps were meant to replay graphs"
    assert engine.async_handoff is (handoff == "on")
