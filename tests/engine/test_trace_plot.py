"""trace-plot: N consecutive decode steps of sync and async traces, drawn into one PNG."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from corelib.cli.main import main
from corelib.cli.trace_plot import load_trace, plot_traces, render, select_window
from corelib.engine import Engine, SamplingParams
from corelib.errors import ConfigError

EMULATED = ["backend=cuda", "backend.runtime=emulated", "engine.max_num_seqs=2", "model.max_model_len=128",
            "engine.trace=true"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    paths = {}
    for handoff in ("off", "on"):
        with Engine.from_overrides([*EMULATED, f"engine.async_token_handoff={handoff}"]) as engine:
            engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=24, ignore_eos=True))
            paths[handoff] = engine.write_trace(tmp_path_factory.mktemp(handoff) / "trace.json")
    return paths


@pytest.mark.slow
def test_window_holds_the_requested_consecutive_decode_steps(traces: dict[str, Path]) -> None:
    timeline = load_trace(traces["on"])
    window = select_window(timeline, 6)
    ids = [s.args["step"] for s in window.steps]
    assert len(ids) == 6
    assert ids == list(range(ids[0], ids[0] + 6))
    assert all(s.args["kind"] == "decode" for s in window.steps)
    assert all(window.start_ms <= start < end <= window.end_ms for start, end in window.gaps)
    assert [s.args["step"] for s in select_window(timeline, 3, first_step=10).steps] == [10, 11, 12]


def test_a_missing_step_or_file_is_one_line(traces: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has no step 999"):
        select_window(load_trace(traces["off"]), 4, first_step=999)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a Chrome trace"):
        load_trace(tmp_path / "bad.json")


def test_sync_and_async_side_by_side_write_a_png(traces: dict[str, Path], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out, windows = plot_traces([traces["off"], traces["on"]], tmp_path / "timeline.png", num_steps=8)
    assert out.read_bytes().startswith(PNG_MAGIC)
    assert [len(w.steps) for w in windows] == [8, 8]


def test_command_line_renders_and_reports_each_trace(traces: dict[str, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots" / "t.png"
    assert main(["trace-plot", str(traces["off"]), str(traces["on"]), "--steps", "5", "--out", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_MAGIC)
    printed = capsys.readouterr().out
    assert printed.count("5 decode steps") == 2
    assert str(out) in printed


def test_without_matplotlib_the_error_names_the_extra(traces: dict[str, Path], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    timeline = load_trace(traces["off"])
    with pytest.raises(ConfigError, match=r"corelib\[bench\]"):
        render([timeline], [select_window(timeline, 4)], tmp_path / "t.png")


def test_a_trace_without_device_spans_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "host-only.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "schedule", "pid": 1, "tid": 1, "ts": 0,
                                                 "dur": 5}]}))
    with pytest.raises(ConfigError, match="no device step spans"):
        select_window(load_trace(path), 4)
