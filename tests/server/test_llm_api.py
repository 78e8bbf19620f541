"""corelib.LLM and corelib.SamplingParams: keywords to overrides, outputs in order, one thread at a time."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import corelib
from corelib import faults
from corelib.engine.api import Engine
from corelib.engine.sequence import SamplingParams as EngineSamplingParams
from corelib.llm import llm_overrides


def overrides_of(model: str = "tiny", backend: str | None = None, tp: int = 1, **options: object) -> list[str]:
    return llm_overrides(model, backend, tp, None, None, (), options)


def test_keywords_map_onto_overrides(tmp_path: Path) -> None:
    assert overrides_of("small-0.6b", "cuda", async_token_handoff="on", max_num_seqs=32, graph=False) == [
        "model=small-0.6b", "backend=cuda", "engine.async_token_handoff=on", "engine.max_num_seqs=32",
        "engine.graph=false",
    ]
    assert overrides_of(str(tmp_path)) == [f"model.path={tmp_path}"]
    assert overrides_of(tp=2) == ["model=tiny", "engine.tp=2", "engine.transport=shm"]
    assert overrides_of(shm={"num_slots": 8}, graph_batch_sizes=[1, 2]) == [
        "model=tiny", "engine.shm.num_slots=8", "engine.graph_batch_sizes=[1,2]"]
    assert llm_overrides("tiny", None, 1, "bfloat16", 256, ["workload.seed=3"], {}) == [
        "model=tiny", "model.dtype=bfloat16", "model.max_model_len=256", "workload.seed=3"]


def test_an_unknown_keyword_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_num_seq'.*max_num_seqs"):
        corelib.LLM(model="tiny", max_num_seq=4)


@pytest.mark.parametrize(("kwargs", "fragment"), [({"model": "huge"}, "neither a preset"),
                                                   ({"tensor_parallel_size": 0}, "tensor_parallel_size")])
def test_a_bad_model_or_size_is_a_value_error(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        corelib.LLM(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
     ({"top_k": 1.5}, "top_k"), ({"stop": [""]}, "stop_strings"), ({"seed": -1}, "seed")],
)
def test_sampling_params_refuse_a_bad_value_at_construction(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}"):
        corelib.SamplingParams(**kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llm() -> Iterator[corelib.LLM]:
    with corelib.LLM(model="tiny", backend="npu", max_num_seqs=8) as built:
        yield built


def test_generate_takes_one_prompt_or_many_and_keeps_their_order(llm: corelib.LLM) -> None:
    params = corelib.SamplingParams(max_tokens=6, temperature=0.7, seed=5, ignore_eos=True)
    with Engine.from_overrides(["model=tiny", "backend=npu"]) as engine:
        want = engine.generate([[3, 4, 5], [9, 8]], params.to_engine())
    [single] = llm.generate([3, 4, 5], params)
    assert single.output_token_ids == want[0].output_token_ids
    both = llm.generate([[3, 4, 5], [9, 8]], [params, EngineSamplingParams(max_tokens=6, temperature=0.7, seed=5,
                                                                           ignore_eos=True)])
    assert [o.output_token_ids for o in both] == [o.output_token_ids for o in want]


def test_a_second_thread_is_refused_while_generate_runs(llm: corelib.LLM) -> None:
    failures: list[Exception] = []

    def held_generate() -> None:
        try:
            llm.generate([[3, 4, 5]] * 4, corelib.SamplingParams(max_tokens=8, ignore_eos=True))
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            failures.append(error)

    # The engine runs in this process: a gate holds the first thread's first forward, so its
    # generate is known to be running, however fast this machine decodes.
    with faults.gate("forward", hit=1) as held:
        runner = threading.Thread(target=held_generate)
        runner.start()
        assert held.reached.wait(60), "the first generate never reached the device"
        with pytest.raises(RuntimeError, match="already running in another thread"):
            llm.generate([1, 2], corelib.SamplingParams(max_tokens=2))
    runner.join(60)
    assert not runner.is_alive()
    assert not failures, failures
    assert llm.generate([1, 2], corelib.SamplingParams(max_tokens=2))[0].finish_reason == "length"
