"""trace-plot on a trace.json that is not what corelib writes: one line naming the event, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from corelib.cli.main import main

SPAN = {"ph": "X", "name": "step", "cat": "step", "pid": 1, "tid": 0, "ts": 10.0, "dur": 5.0, "args": {}}


@pytest.mark.parametrize(
    ("events", "says"),
    [
        ([{k: v for k, v in SPAN.items() if k != "ts"}], "trace event 0 has no 'ts'"),
        ([SPAN, {"ph": "M", "name": "thread_name", "pid": 1, "tid": 0}], "trace event 1 has no 'args'"),
        ([{"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": 0, "args": {}}],
         "trace event 0 has no 'sort_index'"),
        ([7], "trace event 0 is malformed (a int, not an object)"),
        ([{**SPAN, "args": [1, 2]}], "trace event 0 is malformed (its args are a list, not an object)"),
        ([{**SPAN, "ts": "soon"}], "trace event 0 is malformed (could not convert string to float: 'soon')"),
        ({"not": "a list"}, "traceEvents is a dict, not a list of events"),
    ],
    ids=["span-without-ts", "name-without-args", "order-without-index", "event-a-number", "args-a-list",
         "ts-a-word", "events-a-dict"],
)
def test_a_trace_without_the_expected_keys_is_one_line(events: object, says: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    assert main(["trace-plot", str(trace), "--out", str(tmp_path / "t.png")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"corelib: error: {trace}: {says}"), line
