"""Workloads: Poisson arrivals, a concurrency cap and JSONL datasets, through `run`, `bench` and the driver."""

from __future__ import annotations

import itertools
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from corelib.cli import bench as bench_module
from corelib.cli import run as run_module
from corelib.cli.bench import decode_graph_sizes
from corelib.cli.main import main
from corelib.cli.run import drive
from corelib.config.schema import WorkloadConfig
from corelib.engine.api import Engine
from corelib.engine.outputs import RequestOutput
from corelib.engine.sequence import SamplingParams
from corelib.errors import ConfigError
from corelib.loadtest import workload as workload_module
from corelib.loadtest.workload import Request, arrival_offsets, build_workload
from corelib.observe.rundir import read_outputs


def workload(**values: object) -> WorkloadConfig:
    cfg = WorkloadConfig()
    for key, value in values.items():
        setattr(cfg, key, value)
    return cfg


def test_poisson_arrivals_have_the_asked_rate_and_repeat_with_the_seed() -> None:
    offsets = arrival_offsets(workload(request_rate=50.0, seed=3), 4000)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert offsets[0] == 0.0 and all(gap >= 0 for gap in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / 50.0, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 50.0, rel=0.1)  # exponential gaps: stdev = mean
    assert offsets == arrival_offsets(workload(request_rate=50.0, seed=3), 4000)
    assert offsets != arrival_offsets(workload(request_rate=50.0, seed=4), 4000)


@pytest.mark.parametrize("rate", [0.0, float("inf")])
def test_rate_zero_or_inf_sends_everything_at_once(rate: float) -> None:
    assert arrival_offsets(workload(request_rate=rate), 5) == [0.0] * 5


def test_arrivals_leave_the_prompts_of_the_seed_unchanged() -> None:
    burst = build_workload(workload(), 512, 1)
    paced = build_workload(workload(request_rate=5.0), 512, 1)
    assert [r.prompt_token_ids for r in burst] == [r.prompt_token_ids for r in paced]


@pytest.mark.parametrize(("values", "message"), [
    ({"request_rate": -1.0}, "workload.request_rate=-1.0: must be >= 0"),
    ({"request_rate": float("nan")}, "workload.request_rate=nan: must be >= 0"),
    ({"max_concurrency": -2}, "workload.max_concurrency=-2: must be >= 0"),
    ({"prompts": ["hi"], "dataset": "x.jsonl"}, "workload.prompts and workload.dataset are both set"),
])
def test_bad_arrival_settings_are_one_line(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(".", r"\.")):
        build_workload(workload(**values), 512, 1)


def write_jsonl(path: Path, *entries: object) -> Path:
    path.write_text("".join((e if isinstance(e, str) else json.dumps(e)) + "\n" for e in entries))
    return path


def test_a_dataset_gives_one_request_a_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", {"prompt_token_ids": [5, 6, 7], "max_tokens": 3}, "",
                       {"prompt_token_ids": [8, 9]})
    requests = build_workload(workload(dataset=str(path), output_len_max=11), 512, 1)
    assert [r.prompt_token_ids for r in requests] == [[5, 6, 7], [8, 9]]
    assert [r.sampling.max_tokens for r in requests] == [3, 11]


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "line 2 is not valid JSON"),
    ('["a list"]', "line 2 is a JSON list"),
    ('{"prompt": "a", "prompt_token_ids": [1]}', "line 2 has both prompt and prompt_token_ids"),
    ('{"max_tokens": 3}', "line 2 has neither prompt and prompt_token_ids"),
    ('{"prompt_token_ids": [1, -2]}', "line 2: prompt_token_ids must be a list of token ids"),
    ('{"prompt_token_ids": [1], "max_tokens": 0}', "line 2: max_tokens=0 must be an integer >= 1"),
    ('{"prompt": "text"}', "has prompts in text and need a tokenizer"),
    ('{"prompt_token_ids": [' + "9" * 5000 + "]}", "line 2 cannot be read as JSON: Exceeds the limit (4300 digits)"),
    ('{"prompt_token_ids": ' + "[" * 50_000 + "]" * 50_000 + "}", "line 2 is nested deeper than 64 levels"),
])
def test_a_bad_dataset_line_is_named(tmp_path: Path, line: str, message: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", {"prompt_token_ids": [5]}, line)
    with pytest.raises(ConfigError) as caught:
        build_workload(workload(dataset=str(path)), 512, 1)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert f"workload.dataset={path}" in str(caught.value)


def test_a_missing_dataset_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        build_workload(workload(dataset=str(tmp_path / "absent.jsonl")), 512, 1)


def test_a_dataset_that_never_ends_is_refused_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fifo = tmp_path / "requests.jsonl"
    os.mkfifo(fifo)  # opening it to read would wait for a writer for ever
    with pytest.raises(ConfigError, match=r"requests\.jsonl is a FIFO, not a regular file"):
        build_workload(workload(dataset=str(fifo)), 512, 1)
    with pytest.raises(ConfigError, match="/dev/zero is a character device, not a regular file"):
        build_workload(workload(dataset="/dev/zero"), 512, 1)  # read until memory runs out
    monkeypatch.setattr(workload_module, "DATASET_LIMIT", 64)
    big = write_jsonl(tmp_path / "big.jsonl", *[{"prompt_token_ids": [5, 6]}] * 10)
    with pytest.raises(ConfigError, match="more than the 64 this file may have"):
        build_workload(workload(dataset=str(big)), 512, 1)


# ---------------------------------------------------------------------------------- the driver


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine.from_overrides(["backend=cpu", "engine.max_num_seqs=8"]) as built:
        yield built


class Watch:
    """Records when each request was added (by ``clock``) and how many were in flight at any time."""

    def __init__(self, engine: Engine, monkeypatch: pytest.MonkeyPatch,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.start = clock()
        self.added: list[float] = []
        self.in_flight = self.most_in_flight = 0
        self.outputs: list[RequestOutput] = []
        add = engine.add_request

        def counted_add(*args: object, **kwargs: object) -> str:
            self.added.append(self.clock() - self.start)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            return add(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(engine, "add_request", counted_add)

    def finished(self, request: Request, output: RequestOutput) -> None:
        self.in_flight -= 1
        self.outputs.append(output)


def test_a_concurrency_cap_holds_requests_back_until_one_finishes(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = build_workload(workload(num_requests=8, output_len_min=4, output_len_max=6), engine.vocab_size, 1)
    watch = Watch(engine, monkeypatch)
    drive(engine, requests, [0.0] * 8, 2, watch.finished)
    assert watch.most_in_flight == 2
    assert len(watch.outputs) == 8 and all(o.finish_reason == "length" for o in watch.outputs)


class ScriptedClock:
    """The driver's time, without the machine's: its sleeps advance it, and each engine step takes STEP_S."""

    STEP_S = 0.01

    def __init__(self, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 0.0
        step = engine.step

        def timed_step() -> list[RequestOutput]:
            self.now += self.STEP_S
            return step()

        monkeypatch.setattr(engine, "step", timed_step)
        monkeypatch.setattr(run_module, "time", self)

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.slow
def test_requests_join_at_their_arrival_times(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    # 20 tokens each: later requests arrive while earlier ones run, and must join at the next step.
    requests = build_workload(workload(num_requests=4, output_len_min=20, output_len_max=20), engine.vocab_size, 1)
    offsets = [0.0, 0.013, 0.117, 0.441]  # the last arrives when the engine is idle: the driver sleeps until then
    clock = ScriptedClock(engine, monkeypatch)
    watch = Watch(engine, monkeypatch, clock.perf_counter)
    drive(engine, requests, offsets, 0, watch.finished)
    late = [(offset, added) for offset, added in zip(offsets, watch.added, strict=True)
            if not offset - 1e-9 <= added < offset + ScriptedClock.STEP_S]
    assert not late, f"(arrival, added) not added at the first step after arriving: {late}"
    assert len(watch.outputs) == 4


def test_run_serves_a_dataset_at_a_rate_and_writes_latencies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    path = write_jsonl(tmp_path / "d.jsonl", *({"prompt_token_ids": [5 + i, 6, 7], "max_tokens": 2 + i}
                                              for i in range(5)))
    code = main(["run", "backend=cpu", "engine.max_num_seqs=4", f"workload.dataset={path}", "workload.ignore_eos=true",
                 "workload.request_rate=100", "workload.max_concurrency=3", f"hydra.run.dir={tmp_path / 'run'}"])
    assert code == 0
    records = sorted(read_outputs(tmp_path / "run" / "outputs.jsonl"), key=lambda r: int(r["id"]))
    assert [len(r["output_token_ids"]) for r in records] == [2, 3, 4, 5, 6]
    assert all(r["ttft_ms"] > 0 and r["tpot_ms"] > 0 for r in records)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert (metrics["request_rate"], metrics["max_concurrency"]) == (100.0, 3)
    assert "Poisson, 100 requests/s, at most 3 in flight" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_serves_the_workload_beside_its_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["bench", "backend=cpu", "bench.batch_sizes=[1]", "bench.handoff=[off]", "bench.output_len=4",
                 "bench.warmup_steps=2", "workload.num_requests=5", "workload.max_concurrency=2",
                 "workload.output_len_max=4", "workload.output_len_min=2", f"hydra.run.dir={tmp_path / 'bench'}"])
    assert code == 0
    report = json.loads((tmp_path / "bench" / "bench.json").read_text())
    served = report["served"]
    assert len(served) == 2  # one per engine of the sweep: inproc and shm
    slowest = {p["transport"]: p["transport_us_slowest"] for p in report["points"]}
    assert slowest["inproc"] == []
    steps = [at for at, _, _ in slowest["shm"]]
    hops = [us for _, us, _ in slowest["shm"]]
    assert 0 < len(hops) <= 5 and hops == sorted(hops, reverse=True) and len(set(steps)) == len(steps)
    assert all(0 <= wake <= us for _, us, wake in slowest["shm"])  # the wake-up is a part of the hop
    [shm] = [p for p in report["points"] if p["transport"] == "shm"]
    assert hops[0] >= shm["transport_us_p99"] >= shm["transport_us_p50"]
    assert shm["transport_wake_us_p99"] is not None and shm["transport_wake_us_p99"] <= shm["transport_us_p99"]
    for entry in served:
        assert (entry["requests"], entry["requests_failed"], entry["max_concurrency"]) == (5, 0, 2)
        assert entry["ttft_ms_p50"] > 0 and entry["tokens_per_s"] > 0


@pytest.mark.slow
def test_bench_decodes_with_the_sampling_it_is_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    measured: list[tuple[float, float]] = []
    measure = bench_module._measure

    def spy(engine: Engine, batch_size: int, prompt_len: int, sampling: SamplingParams, seed: int
            ) -> tuple[float, float]:
        measured.append((sampling.temperature, sampling.top_p))
        return measure(engine, batch_size, prompt_len, sampling, seed)

    monkeypatch.setattr(bench_module, "_measure", spy)
    code = main(["bench", "backend=cpu", "bench.batch_sizes=[2]", "bench.handoff=[off]", "bench.transport=[inproc]",
                 "bench.output_len=4", "bench.warmup_steps=2", "bench.temperature=1.0", "bench.top_p=0.9",
                 f"hydra.run.dir={tmp_path / 'bench'}"])
    assert code == 0
    report = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert (report["bench"]["temperature"], report["bench"]["top_p"]) == (1.0, 0.9)
    assert [p["batch_size"] for p in report["points"]] == [2]
    assert " temperature=1 top_p=0.9 bs=2: TPOT " in capsys.readouterr().err
    assert measured and set(measured) == {(1.0, 0.9)}, "the warm-up and the timed batches draw"


@pytest.mark.long  # an emulated engine that captures graphs (about 20 s)
def test_bench_replays_a_decode_graph_of_each_batch_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # bs 3 against buckets of 1 and 2: without a bucket of its own its decode steps would run eagerly
    monkeypatch.chdir(tmp_path)
    seen: list[tuple[tuple[int, ...], set[int]]] = []
    measure = bench_module._measure

    def spy(engine: Engine, batch_size: int, prompt_len: int, sampling: SamplingParams, seed: int
            ) -> tuple[float, float]:
        result = measure(engine, batch_size, prompt_len, sampling, seed)
        runner = engine.local_runner
        seen.append((runner.buckets.batch_buckets, {key[0] for key in runner.graphs}))
        return result

    monkeypatch.setattr(bench_module, "_measure", spy)
    code = main(["bench", "backend=npu", "bench.batch_sizes=[3]", "bench.handoff=[off]", "bench.transport=[inproc]",
                 "bench.output_len=4", "bench.warmup_steps=2", "bench.prompt_len=4", "engine.graph_batch_sizes=[1,2]",
                 "bench.prompt_lens=[]", f"hydra.run.dir={tmp_path / 'bench'}"])
    assert code == 0
    assert seen and all(buckets == (1, 2, 3) and 3 in rows for buckets, rows in seen), seen


def test_the_bench_adds_its_batch_sizes_to_the_decode_graph_buckets() -> None:
    assert decode_graph_sizes([1, 2, 4, 8, 16, 32, 64], [1, 8, 128]) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert decode_graph_sizes([1, 32], [32, 1]) == [1, 32]
