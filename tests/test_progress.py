"""Long steps show progress: periodic lines on a pipe, a bar on a terminal, everything in run.log."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
from rich.console import Console

from corelib.cli.main import main
from corelib.support.progress import INTERVAL_ENV, Progress, current, reporting


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def piped() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=False, width=200), out


def test_a_pipe_gets_a_line_every_interval_and_one_at_the_end(caplog: pytest.LogCaptureFixture) -> None:
    console, out = piped()
    clock = FakeClock()
    progress = Progress(console, interval_s=5.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="corelib"), \
            progress.task("loading weights", total=10, unit="tensors") as task:
        for _ in range(10):
            clock.now += 1.5
            task.advance()
    lines = out.getvalue().splitlines()
    assert lines == [
        "corelib: loading weights: 4/10 tensors (40 %), 6 s",
        "corelib: loading weights: 8/10 tensors (80 %), 12 s",
        "corelib: loading weights: 10/10 tensors in 15.0 s",
    ]
    logged = [r.getMessage() for r in caplog.records]
    assert "loading weights: started (10 tensors)" in logged
    assert all(line.removeprefix("corelib: ") in logged for line in lines)


def test_a_quick_task_prints_nothing_on_a_pipe_but_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    console, out = piped()
    with caplog.at_level(logging.INFO, logger="corelib"), \
            Progress(console, interval_s=5.0).task("capturing decode graphs", total=3, unit="graphs") as task:
        for _ in range(3):
            task.advance()
    assert out.getvalue() == ""
    assert any(r.getMessage().startswith("capturing decode graphs: 3/3 graphs in") for r in caplog.records)


def test_a_terminal_gets_a_bar_and_no_lines() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with Progress(console, interval_s=0.0).task("decoding", total=4, unit="requests") as task:
        task.advance(2)
        console.file.flush()
    assert "corelib: decoding" not in out.getvalue()  # no plain lines where a bar draws


def test_outside_a_command_the_reporter_only_logs() -> None:
    assert current().console is None
    console, _ = piped()
    mine = Progress(console)
    with reporting(mine):
        assert current() is mine
    assert current() is not mine


def run_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str) -> Path:
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    code = main(["run", "backend=cpu", "engine.max_num_seqs=4", "workload.num_requests=6", *overrides,
                 f"hydra.run.dir={run_dir}"])
    assert code == 0
    return run_dir


@pytest.mark.slow
def test_a_piped_run_prints_periodic_progress_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(INTERVAL_ENV, "0")  # a line at every step of progress, so a quick run shows them
    run_in_process(tmp_path, monkeypatch)
    shown = capsys.readouterr().err  # status: stderr
    assert "corelib: placing weights on the device: 1/" in shown  # before the first request: the silent minute
    assert "corelib: decoding: 6/6 requests in " in shown


@pytest.mark.slow
def test_run_log_keeps_what_the_console_showed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Periodic lines at every step, so the console shows the decoding task (and its end) however
    # fast this machine runs it; the end line is then on the console once and in the log once.
    monkeypatch.setenv(INTERVAL_ENV, "0")
    run_dir = run_in_process(tmp_path, monkeypatch)
    log = (run_dir / "run.log").read_text()
    shown = capsys.readouterr()
    for fragment in ("cpu: native", "allocating the KV cache", "decoding: 6/6 requests",
                     "run summary", "tokens/s", f"wrote {run_dir}"):
        assert fragment in log, f"{fragment!r} is not in run.log:\n{log}"
    assert "run summary" in shown.err
    assert shown.out == "", "status goes to stderr; stdout holds generated text only (none: token-id prompts)"
    # The log's lines do not show twice: its handler on the console takes warnings only.
    assert shown.err.count("cpu: native") == 1 and shown.err.count("decoding: 6/6 requests") == 1
