"""engine.trace=true: a Chrome trace with host lanes and per-step device spans, for sync and async runs."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from corelib.cli.main import main
from corelib.engine import Engine, SamplingParams
from corelib.errors import ConfigError
from corelib.observe.trace import NULL_TRACER, TimelineTracer

EngineFactory = Callable[[Sequence[str]], Engine]  # the make_engine fixture of conftest.py
EMULATED = ["backend=cuda", "backend.runtime=emulated", "engine.max_num_seqs=4", "model.max_model_len=128"]
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
NEW_TOKENS = 12


def lanes_of(trace: dict[str, Any]) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}


def spans_on(trace: dict[str, Any], lane: str) -> list[dict[str, Any]]:
    names = lanes_of(trace)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and names[(e["pid"], e["tid"])] == lane]
    return sorted(spans, key=lambda e: e["ts"])


def traced_run(make_engine: EngineFactory, tmp_path: Path, handoff: str,
               reanchor_s: float | None = None) -> tuple[dict[str, Any], int]:
    engine = make_engine([*EMULATED, "engine.trace=true", f"engine.async_token_handoff={handoff}"])
    if reanchor_s is not None:
        assert isinstance(engine.tracer, TimelineTracer), "engine.trace=true gives a recording tracer"
        engine.tracer.reanchor_s = reanchor_s
    engine.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    path = engine.write_trace(tmp_path / "trace.json")
    return json.loads(path.read_text()), engine.core.metrics.num_steps


@pytest.mark.parametrize("handoff", ["off", "on"])
@pytest.mark.slow
def test_trace_has_each_lane_and_one_device_span_per_step(make_engine: EngineFactory, tmp_path: Path,
                                                         handoff: str) -> None:
    trace, num_steps = traced_run(make_engine, tmp_path, handoff)
    lanes = set(lanes_of(trace).values())
    assert {"scheduler", "compute", "d2h"} <= lanes
    assert "submission" not in lanes, "steps are launched from the scheduler's own thread"
    steps = [e for e in spans_on(trace, "compute") if e["cat"] == "step"]
    assert sorted(e["args"]["step"] for e in steps) == list(range(num_steps))
    decode = [e for e in steps if e["args"]["kind"] == "decode"]
    assert decode, "a run of several tokens has decode steps"
    assert {e["args"]["path"] for e in decode} == {"async" if handoff == "on" else "sync"}
    assert {e["args"]["batch"] for e in decode} == {len(PROMPTS)}
    copies = spans_on(trace, "d2h")
    assert sorted(e["args"]["step"] for e in copies) == list(range(num_steps))
    host = {e["name"] for e in spans_on(trace, "scheduler")}
    assert {"schedule", "pack", "wait for tokens", "postprocess"} <= host
    submitter = "scheduler"
    assert {e["args"]["step"] for e in spans_on(trace, submitter) if e["name"] == "submit"} == set(range(num_steps))
    assert trace["otherData"]["corelib"]["async_token_handoff"] == (handoff == "on")
    assert trace["otherData"]["corelib"]["dropped_events"] == 0


@pytest.mark.parametrize(("handoff", "reanchor_s"), [("off", None), ("on", None), ("on", 0.0)],
                         ids=["sync", "async", "async-reanchor-every-step"])
def test_device_spans_on_the_compute_lane_never_overlap(make_engine: EngineFactory, tmp_path: Path,
                                                        handoff: str, reanchor_s: float | None) -> None:
    trace, num_steps = traced_run(make_engine, tmp_path, handoff, reanchor_s)
    anchors = [e for e in spans_on(trace, "scheduler") if e["name"] == "trace anchor"]
    assert len(anchors) == (1 if reanchor_s is None else num_steps + 1)
    spans = spans_on(trace, "compute")
    for before, after in itertools.pairwise(spans):
        assert after["ts"] >= before["ts"] + before["dur"] - 1e-3, (before["name"], after["name"])
    for copy in spans_on(trace, "d2h"):
        step = next(e for e in spans if e["args"]["step"] == copy["args"]["step"])
        assert copy["ts"] >= step["ts"] + step["dur"] - 1e-3, "a step's tokens are copied after its compute"


@pytest.mark.slow
def test_run_command_writes_trace_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    assert main(["run", "backend=cpu", "engine.trace=true", "workload.num_requests=3", "workload.output_len_min=4",
                 "workload.output_len_max=8",
                 "engine.max_num_seqs=2", f"hydra.run.dir={run_dir}"]) == 0
    trace = json.loads((run_dir / "trace.json").read_text())
    assert [e for e in trace["traceEvents"] if e.get("cat") == "step"], "the cpu device times its steps too"
    assert "trace.json" in capsys.readouterr().err


def test_disabled_trace_records_nothing_and_times_no_copy(make_engine: EngineFactory) -> None:
    engine = make_engine(EMULATED)
    assert engine.tracer is NULL_TRACER
    assert engine.core.tracer is NULL_TRACER
    assert not engine.local_runner.handoff.time_tokens
    with pytest.raises(ConfigError, match=r"engine\.trace=true"):
        engine.write_trace("unused.json")


def test_spans_from_other_threads_get_their_own_lane(tmp_path: Path) -> None:
    tracer = TimelineTracer()

    def poll() -> None:
        with tracer.span("materialize", step=3):
            pass
        with tracer.span("h2d issue", lane="polling"):
            pass
        tracer.instant("slot reused", lane="polling")

    thread = threading.Thread(target=poll, name="corelib-poll")
    thread.start()
    thread.join()
    with tracer.span("schedule", lane="scheduler"):
        pass
    trace = json.loads(tracer.write(tmp_path / "trace.json").read_text())
    assert [e["args"] for e in spans_on(trace, "corelib-poll")] == [{"step": 3}]
    assert [e["name"] for e in spans_on(trace, "polling")] == ["h2d issue"]
    assert [e["name"] for e in trace["traceEvents"] if e["ph"] == "i"] == ["slot reused"]
    assert [e["name"] for e in spans_on(trace, "scheduler")] == ["schedule"]


def test_recording_stops_at_the_cap_and_the_file_says_so(tmp_path: Path) -> None:
    tracer = TimelineTracer(max_events=5)
    for i in range(12):
        with tracer.span(f"span {i}", lane="scheduler"):
            pass
    trace = json.loads(tracer.write(tmp_path / "trace.json").read_text())
    assert [e["name"] for e in spans_on(trace, "scheduler")] == [f"span {i}" for i in range(5)]
    info = trace["otherData"]["corelib"]
    assert info["dropped_events"] == 7
    assert any("5 events" in note for note in info["notes"])
    assert [e["name"] for e in trace["traceEvents"] if e["ph"] == "i"] == ["trace truncated"]
