"""corelib.LLM and corelib.SamplingParams in vLLM's shape: keywords to overrides, outputs in order, n, seeds, chat."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import corelib
from corelib import LLM, SamplingParams
from corelib.errors import ConfigError
from corelib.llm import llm_overrides
from corelib.models.synthetic import write_text_checkpoint
from corelib.support import faults


def overrides_of(model: str = "tiny", backend: str | None = None, tp: int = 1, **options: object) -> list[str]:
    return llm_overrides(model, backend, tp, None, None, (), options)


def test_keywords_map_onto_overrides(tmp_path: Path) -> None:
    assert overrides_of("small-0.6b", "cuda", async_token_handoff="on", max_num_seqs=32, graph=False) == [
        "model=small-0.6b", "backend=cuda", "engine.async_token_handoff=on", "engine.max_num_seqs=32",
        "engine.graph=false",
    ]
    assert overrides_of(str(tmp_path)) == [f"model.path={tmp_path}"]
    assert overrides_of("Qwen/Qwen3-0.6B") == ["model.path=Qwen/Qwen3-0.6B"]  # a hub id, as the CLI takes it
    assert overrides_of(tp=2) == ["model=tiny", "engine.tp=2", "engine.transport=shm"]
    assert overrides_of(shm={"num_slots": 8}, graph_batch_sizes=[1, 2]) == [
        "model=tiny", "engine.shm.num_slots=8", "engine.graph_batch_sizes=[1,2]"]
    assert llm_overrides("tiny", None, 1, "bfloat16", 256, ["workload.seed=3"], {}) == [
        "model=tiny", "model.dtype=bfloat16", "model.max_model_len=256", "workload.seed=3"]


def test_an_unknown_keyword_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_num_seq'.*max_num_seqs"):
        corelib.LLM(model="tiny", max_num_seq=4)
    with pytest.raises(TypeError, match=r"'tokenizer': the tokenizer is the checkpoint's tokenizer.json"):
        corelib.LLM(model="tiny", tokenizer="elsewhere")


def test_trust_remote_code_is_said_once_and_the_launch_goes_on() -> None:
    # A vLLM script's keyword: a warning naming why it changes nothing (the unknown keyword after it stops the
    # build before an engine starts).
    with pytest.warns(UserWarning, match=r"trust_remote_code=True\): corelib never runs a checkpoint's code"), \
            pytest.raises(TypeError, match="max_num_seq"):
        corelib.LLM(model="tiny", trust_remote_code=True, max_num_seq=4)


@pytest.mark.parametrize(("kwargs", "fragment"), [({"model": "huge"}, "neither a preset"),
                                                   ({"model": "../not/a/dir/or/id"}, "nor a hub id"),
                                                   ({"tensor_parallel_size": 0}, "tensor_parallel_size")])
def test_a_bad_model_or_size_is_a_value_error(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        corelib.LLM(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
     ({"top_k": 1.5}, "top_k"), ({"stop": [""]}, "stop"), ({"seed": -1}, "seed"), ({"n": 0}, "n"),
     ({"frequency_penalty": 3.0}, "frequency_penalty")],
)
def test_sampling_params_refuse_a_bad_value_at_construction(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}"):
        corelib.SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_there_is_one_sampling_params_class() -> None:
    from corelib.engine import SamplingParams as EngineSamplingParams
    from corelib.engine.sequence import SamplingParams as SequenceSamplingParams
    from corelib.sampling_params import SamplingParams as Defined

    assert corelib.SamplingParams is EngineSamplingParams is SequenceSamplingParams is Defined


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_text_checkpoint(tmp_path_factory.mktemp("text-model"))


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> Iterator[LLM]:
    with LLM(model=str(checkpoint), backend="npu", max_num_seqs=8) as built:
        yield built


def test_the_vllm_script_runs_unchanged(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    PATH = str(checkpoint)  # noqa: N806 - the script as a vLLM user writes it
    llm = LLM(model=PATH); out = llm.generate(["Hello"], SamplingParams(temperature=0.8, max_tokens=16, n=2)); print(out[0].prompt, [o.text for o in out[0].outputs])  # noqa: E501, E702
    llm.close()
    assert capsys.readouterr().out.startswith("Hello [")
    # ...and one with the keywords and fields vLLM's examples and evaluation scripts use
    with pytest.warns(UserWarning, match="trust_remote_code"):
        big = LLM(model=PATH, dtype="auto", max_model_len=256, gpu_memory_utilization=0.9, seed=0,
                  trust_remote_code=True, enforce_eager=True)
    params = SamplingParams(temperature=0.8, top_p=0.95, min_p=0.05, max_tokens=8, min_tokens=2, logprobs=2,
                            prompt_logprobs=1, stop=["\n\n"], include_stop_str_in_output=False)
    [scored] = big.generate(["The quick brown fox"], params)
    big.close()
    assert scored.prompt_logprobs is not None and scored.prompt_logprobs[0] is None
    sample = scored.outputs[0]
    assert sample.logprobs is not None and len(sample.logprobs) == len(sample.token_ids) >= 2
    chosen = zip(sample.logprobs, sample.token_ids, strict=True)
    assert sample.cumulative_logprob == pytest.approx(sum(step[token].logprob for step, token in chosen))
    assert sample.stop_reason in (None, "\n\n")
    [result] = out
    assert result.prompt == "Hello" and result.prompt_token_ids == llm.engine.encode("Hello")
    assert [o.index for o in result.outputs] == [0, 1]
    for sample in result.outputs:
        assert isinstance(sample.text, str) and sample.text
        assert 1 <= len(sample.token_ids) <= 16 and sample.finish_reason in ("stop", "length")
    assert result.outputs[0].token_ids != result.outputs[1].token_ids, "n samples must be distinct"


def test_n_samples_with_a_seed_are_choices_seed_plus_i(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=40, ignore_eos=True)
    [grouped] = llm.generate([[5, 6, 7]], params)
    alone = [llm.generate([[5, 6, 7]], params.replace(n=1, seed=40 + i))[0].output_token_ids for i in range(3)]
    assert [o.token_ids for o in grouped.outputs] == alone
    assert llm.generate([[5, 6, 7]], params)[0].outputs == grouped.outputs, "a seed given is repeatable"


def test_without_a_seed_identical_prompts_get_fresh_randomness(llm: LLM) -> None:
    outs = llm.generate([[5, 6, 7]] * 4, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
    assert len({tuple(o.output_token_ids) for o in outs}) == 4, [o.output_token_ids for o in outs]


def test_an_llm_seed_makes_seedless_requests_repeatable(checkpoint: Path) -> None:
    def run(seed: int) -> list[list[int]]:
        with LLM(model=str(checkpoint), backend="cpu", seed=seed) as llm:
            outs = llm.generate([[5, 6, 7]] * 2, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True))
            return [o.output_token_ids for o in outs]

    first = run(7)
    assert first == run(7) and first[0] != first[1]


def test_penalties_change_what_a_greedy_request_repeats(llm: LLM) -> None:
    plain = SamplingParams(max_tokens=24, ignore_eos=True)
    [greedy] = llm.generate([[5, 6, 7]], plain)
    assert len(set(greedy.output_token_ids)) < 24, "random weights repeat themselves under greedy decoding"
    [penalized] = llm.generate([[5, 6, 7]], plain.replace(presence_penalty=2.0, repetition_penalty=2.0))
    assert len(set(penalized.output_token_ids)) > len(set(greedy.output_token_ids))


def test_a_text_prompt_for_a_preset_is_refused_at_once_naming_the_fix() -> None:
    with LLM(model="tiny", backend="cpu") as llm:
        with pytest.raises(ConfigError) as refused:
            llm.generate(["Hello"], SamplingParams(max_tokens=4))
        assert llm.engine.stats().num_steps == 0, "refused before any work"
    message = str(refused.value)
    assert "model=tiny is a preset with random weights and no tokenizer" in message
    assert "pass token ids" in message and "\n" not in message


def test_chat_renders_the_checkpoint_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    [answer] = llm.chat(messages, SamplingParams(max_tokens=6, ignore_eos=True))
    assert answer.prompt == "<|user|>Hello\n<|assistant|>"
    tokenizer = llm.get_tokenizer()
    assert tokenizer is not None
    [direct] = llm.generate([tokenizer.encode(answer.prompt, add_special_tokens=False)],
                            SamplingParams(max_tokens=6, ignore_eos=True))
    assert answer.outputs[0].token_ids == direct.outputs[0].token_ids
    assert len(llm.chat([messages, messages], SamplingParams(max_tokens=2))) == 2


def test_generate_takes_prompt_dicts_and_keeps_their_order(llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.7, seed=5, ignore_eos=True)
    want = [o.output_token_ids for o in llm.generate([[3, 4, 5], [9, 8]], params)]
    got = llm.generate([{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": [9, 8]}], params, use_tqdm=False)
    assert [o.output_token_ids for o in got] == want
    [single] = llm.generate([3, 4, 5], params)
    assert single.output_token_ids == want[0]


def test_a_second_thread_is_refused_while_generate_runs(llm: LLM) -> None:
    failures: list[Exception] = []

    def held_generate() -> None:
        try:
            llm.generate([[3, 4, 5]] * 4, corelib.SamplingParams(max_tokens=8, ignore_eos=True),
                         use_tqdm=False)
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
    assert llm.generate([1, 2], SamplingParams(max_tokens=2, ignore_eos=True))[0].finish_reason == "length"
