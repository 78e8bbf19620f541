"""What a run leaves behind: per-request latencies, error counts, and whole lines on Ctrl-C or a full disk."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import HERMETIC_VARIABLES

from corelib.cli.main import main
from corelib.observe.rundir import RequestRecord, RunDir, read_outputs
from corelib.support import faults
from corelib.trust.files import RunDirError

pytestmark = pytest.mark.slow


def record(index: int) -> RequestRecord:
    return RequestRecord(str(index), [1, 2, 3], [4] * 50, "length", ttft_ms=1.5, tpot_ms=0.5)


def test_a_disk_that_fills_mid_line_leaves_whole_lines_and_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = os.write
    with RunDir(tmp_path).outputs() as writer:
        room = [2 * len(json.dumps(record(0).as_dict()) + "\n") + 40]  # two lines and part of a third

        def full_disk(fd: int, data: bytes) -> int:
            if fd != writer._fd:
                return real_write(fd, data)
            if room[0] <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            taken = real_write(fd, data[: room[0]])
            room[0] -= taken
            return taken

        monkeypatch.setattr(os, "write", full_disk)
        writer.write(record(0))
        writer.write(record(1))
        with pytest.raises(RunDirError) as caught:
            writer.write(record(2))
        monkeypatch.undo()
    assert str(caught.value) == (f"cannot write {tmp_path / 'outputs.jsonl'}: No space left on device (ENOSPC); "
                                 "it keeps the 2 complete line(s) written before")
    text = (tmp_path / "outputs.jsonl").read_text()
    assert text.endswith("\n") and [r["id"] for r in read_outputs(tmp_path / "outputs.jsonl")] == ["0", "1"]


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 128 KiB tmpfs (needs root, as in CI); skipped where it cannot be mounted."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mount)], capture_output=True,
                          check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip() or done.returncode}")
    try:
        yield mount
    finally:
        # Lazy: the run's log handler may still hold run.log open in this process.
        subprocess.run(["umount", "--lazy", str(mount)], check=True)


def test_a_full_disk_stops_the_run_with_one_line_and_keeps_whole_lines(
    tiny_disk: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    run_dir = tiny_disk / "run"
    code = main(["run", "backend=cpu", "engine.max_num_seqs=8", "workload.num_requests=80",
                 "workload.prompt_len_min=300", "workload.prompt_len_max=300", "workload.output_len_min=2",
                 "workload.output_len_max=2", f"hydra.run.dir={run_dir}"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("corelib: error:")]
    assert code == 1
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"corelib: error: cannot write {run_dir / 'outputs.jsonl'}: No space left on device "
                                "(ENOSPC); it keeps the ")
    kept = read_outputs(run_dir / "outputs.jsonl")  # every line parses: none was cut
    assert 0 < len(kept) < 80
    assert f"it keeps the {len(kept)} complete line(s)" in errors[0]


@pytest.mark.slow
def test_ctrl_c_keeps_the_outputs_of_finished_requests(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # The 200th forward is held until the test releases it: by then at least the first 4 requests
    # (at most 41 steps each) are written, and the run is known to be unfinished, whatever the speed.
    release = tmp_path / "release"
    env = {k: v for k, v in os.environ.items() if k not in HERMETIC_VARIABLES}
    env.update({faults.ENV: "forward@200:hold", faults.RELEASE_ENV: str(release)})
    command = [sys.executable, "-m", "corelib", "run", "backend=cpu", "engine.max_num_seqs=4",
               "workload.num_requests=400", "workload.output_len_min=20", "workload.output_len_max=40",
               f"hydra.run.dir={run_dir}"]
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    outputs = run_dir / "outputs.jsonl"
    try:
        held = Path(f"{release}.held")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None and not held.exists():
            time.sleep(0.05)
        assert held.exists(), f"the run never reached its held forward (exit {process.poll()})"
        assert outputs.read_text().count("\n") >= 3, "fewer than 3 requests were written before the held forward"
        process.send_signal(signal.SIGINT)
        release.touch()  # wherever the held forward runs, it must not keep the process alive
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, stderr
    kept = read_outputs(outputs)
    assert 3 <= len(kept) < 400
    # Finished requests only: at their length, or at an EOS the random weights sampled.
    assert all(r["finish_reason"] in ("length", "stop") and r["ttft_ms"] is not None for r in kept), kept[:3]
    assert (run_dir / "run.log").read_text().rstrip().endswith("- interrupted")  # the log says why it stopped


def test_the_summary_says_how_many_requests_ended_in_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    # Prompts of 8-32 tokens asking for 24-32 more: those over max_model_len=48 are refused, the others run.
    code = main(["run", "backend=cpu", "engine.max_num_seqs=4", "model.max_model_len=48", "engine.refuse_overlong=true",
                 "workload.output_len_min=24", f"hydra.run.dir={tmp_path / 'run'}"])
    assert code == 0
    records = read_outputs(tmp_path / "run" / "outputs.jsonl")
    failed = [r for r in records if r["finish_reason"] == "error"]
    assert 0 < len(failed) < len(records) == 16
    shown = capsys.readouterr().err
    assert f"corelib: {len(failed)} of 16 requests ended in error" in shown
    assert "exceeds model.max_model_len=48" in shown
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["requests_failed"] == len(failed)


def test_plan_says_where_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "backend=cpu", f"hydra.run.dir={tmp_path / 'plan'}"]) == 0
    assert f"corelib: wrote {tmp_path / 'plan'}/{{config.yaml,plan.json}}" in capsys.readouterr().err
    assert (tmp_path / "plan" / "plan.json").is_file()
