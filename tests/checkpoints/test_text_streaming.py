"""Text prompts, decoded outputs and token streaming, with a tokenizer.json trained here."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from corelib.cli.main import main
from corelib.engine.api import Engine
from corelib.engine.sequence import SamplingParams
from corelib.engine.streaming import TokenDelta
from corelib.models.synthetic import tiny_hf_config, write_random_checkpoint, write_toy_tokenizer
from corelib.observe.rundir import read_outputs
from corelib.support.text import Tokenizer

pytestmark = pytest.mark.slow

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A naïve café in the city sells crème brûlée.",
    "Hello world, 世界 says hello back ☃.",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("model")
    write_random_checkpoint(directory, tiny_hf_config("Qwen3ForCausalLM"), shards=2)
    write_toy_tokenizer(directory, CORPUS * 4)
    return directory


def engine_for(directory: Path | None) -> Engine:
    path = [f"model.path={directory}"] if directory else []
    return Engine.from_overrides(["backend=cpu", "engine.max_num_seqs=4", *path])


def by_request(deltas: list[TokenDelta]) -> dict[str, list[TokenDelta]]:
    grouped: dict[str, list[TokenDelta]] = defaultdict(list)
    for delta in deltas:
        grouped[delta.request_id].append(delta)
    return grouped


def test_incremental_text_never_shows_half_a_character(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_directory(model_dir)
    assert tokenizer is not None
    text = "世界 says hello ☃ crème brûlée"
    ids = tokenizer.encode(text)[1:]  # without the BOS
    decoder = tokenizer.stream()
    pieces = [decoder.push([token]) for token in ids]
    assert "".join(pieces) == text
    assert "" in pieces, "a multi-byte character split over tokens should wait for its last byte"
    assert not any("\ufffd" in piece for piece in pieces)


def test_text_prompts_are_encoded_and_outputs_decoded(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_directory(model_dir)
    assert tokenizer is not None
    with engine_for(model_dir) as engine:
        [by_text, by_ids] = engine.generate(["Hello world", tokenizer.encode("Hello world")],
                                            SamplingParams(max_tokens=12, ignore_eos=True))
    assert by_text.prompt_token_ids == tokenizer.encode("Hello world") and by_text.prompt_token_ids[0] == 0
    assert by_text.output_token_ids == by_ids.output_token_ids and len(by_text.output_token_ids) == 12
    assert by_text.text == tokenizer.decode(by_text.output_token_ids)


def test_stream_tokens_delivers_every_token_and_the_same_text_as_the_output(model_dir: Path) -> None:
    with engine_for(model_dir) as engine:
        for prompt, max_tokens in (("The quick brown", 9), ("crème", 14), ([0, 5, 6, 7], 5)):
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        grouped = by_request(list(engine.stream_tokens()))
    assert sorted(grouped) == ["0", "1", "2"]
    for deltas in grouped.values():
        output = deltas[-1].output
        assert output is not None and all(d.output is None for d in deltas[:-1])
        assert len(deltas) > 1, "tokens should arrive while the request is still running"
        assert [t for d in deltas for t in d.token_ids] == output.output_token_ids
        assert "".join(d.text for d in deltas) == output.text


def test_a_stop_string_ends_the_text_before_it_and_is_never_streamed(model_dir: Path) -> None:
    prompt, params = "Hello world", SamplingParams(max_tokens=24, ignore_eos=True)
    with engine_for(model_dir) as engine:
        [free] = engine.generate([prompt], params)
        text = free.text or ""
        start = next(i for i in range(len(text) // 3, len(text) - 2) if "\ufffd" not in text[i : i + 2])
        stop = text[start : start + 2]
        engine.add_request(prompt, SamplingParams(max_tokens=24, ignore_eos=True, stop=stop))
        deltas = list(engine.stream_tokens())
    output = deltas[-1].output
    assert output is not None and output.finish_reason == "stop"
    assert output.text == text[: text.find(stop)]
    assert len(output.output_token_ids) < len(free.output_token_ids)
    assert "".join(d.text for d in deltas) == output.text


def test_without_a_tokenizer_streaming_gives_token_ids_only() -> None:
    with engine_for(None) as engine:
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
        deltas = list(engine.stream_tokens())
    output = deltas[-1].output
    assert output is not None and output.text is None
    assert [t for d in deltas for t in d.token_ids] == output.output_token_ids
    assert all(d.text == "" for d in deltas)


def test_run_streams_the_text_of_one_prompt_and_writes_it(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    overrides = ["backend=cpu", "engine.max_num_seqs=2", f"model.path={model_dir}", "workload.ignore_eos=true",
                 "workload.output_len_max=10", f"hydra.run.dir={tmp_path / 'run'}"]
    assert main(["run", *overrides, "workload.prompts=[The quick brown fox]"]) == 0
    [record] = read_outputs(tmp_path / "run" / "outputs.jsonl")
    assert len(record["output_token_ids"]) == 10
    shown = capsys.readouterr()
    assert shown.out == "The quick brown fox" + record["text"] + "\n", "stdout holds the generated text only"
    assert "corelib: cpu: native" in shown.err and "run summary" in shown.err, "status goes to stderr"
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["startup"][0].startswith(f"model.path={model_dir}")


def test_run_prints_each_answer_of_several_prompts(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    overrides = ["backend=cpu", "engine.max_num_seqs=2", f"model.path={model_dir}", "workload.output_len_max=8",
                 f"hydra.run.dir={tmp_path / 'run'}"]
    assert main(["run", *overrides, 'workload.prompts=["Hello world", "crème brûlée", "The lazy dog"]']) == 0
    records = read_outputs(tmp_path / "run" / "outputs.jsonl")
    shown = capsys.readouterr().out
    assert [r["id"] for r in records] == ["0", "1", "2"]
    for record, prompt in zip(records, ["Hello world", "crème brûlée", "The lazy dog"], strict=True):
        assert f"request {record['id']}" in shown and prompt + record["text"] + "\n" in shown


def test_streaming_on_the_async_path_gives_the_synchronous_tokens_and_text(model_dir: Path) -> None:
    prompts = ["The quick brown", "crème brûlée", "Hello world, 世界"]
    params = SamplingParams(max_tokens=20)
    with engine_for(model_dir) as engine:
        expected = engine.generate(prompts, params)
    overrides = ["backend=npu", "backend.runtime=emulated", "backend.emulator.chaos=0.2",
                 "backend.emulator.chaos_max_ms=0.5", "engine.async_token_handoff=on", "engine.max_num_seqs=4",
                 f"model.path={model_dir}"]
    with Engine.from_overrides(overrides) as engine:
        for prompt in prompts:
            engine.add_request(prompt, params)
        grouped = by_request(list(engine.stream_tokens()))
        async_steps = engine.metrics(1.0)["steps_async"]
        assert isinstance(async_steps, int) and async_steps > 0, "the run should take the async path"
    for want, deltas in zip(expected, (grouped[str(i)] for i in range(len(prompts))), strict=True):
        assert [t for d in deltas for t in d.token_ids] == want.output_token_ids
        assert "".join(d.text for d in deltas) == want.text
