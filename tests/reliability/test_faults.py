"""Fault injection: every fault ends in bounded time, names its cause, and leaves nothing behind.

One table, two surfaces. Through the API a fault is an exception from the engine (then every
request is finished, later steps are refused, and close releases everything); through
``python -m corelib run`` it is a non-zero exit with the cause on stderr, no traceback, no
worker left running and no SHM segment left in /dev/shm. Faults inside the engine are armed
with ``CORELIB_FAULTS`` (corelib.support.faults): in this process through ``faults.injected``, in worker
processes through the environment they inherit.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest
from leakkit import Holdings, children, is_running, segments, settled
from support import HERMETIC_VARIABLES

from corelib.engine import Engine, SamplingParams
from corelib.errors import DeviceError, DeviceTimeout, TransportError, WorkerDied
from corelib.observe.rundir import read_outputs
from corelib.support import faults
from corelib.transport.shm_executor import ShmExecutor

TIMEOUT_S = 1.0  # engine.timeout_s of the stall cases: what a stalled wait may cost
CALM_TIMEOUT_S = 60.0  # the other cases': no wait of theirs may time out on a busy machine
SMALL = ["backend=npu", "engine.async_token_handoff=on", "engine.max_num_seqs=4", "model.max_model_len=256"]
SHM = ("engine.transport=shm",)
KILL = "SIGKILL to worker rank 0"
SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM}
API, CLI = "api", "cli"
STALL_S = 6.0  # an in-process stall must end for its thread to end; in a worker it lasts until the kill


@dataclass(frozen=True)
class Fault:
    name: str
    what: str  # the fault, in the words
    inject: str  # a CORELIB_FAULTS value, KILL, or a signal to the CLI process
    message: str  # regex: how the error names the cause (the API's exception, the CLI's stderr)
    overrides: tuple[str, ...] = ()
    error: tuple[type[BaseException], ...] = ()  # the API's exception; () for CLI-only faults
    exit_code: int = 1
    # Bounds that tell a hang from an answer, not speed requirements (a loaded machine takes its
    # time; the figures printed are what docs/reliability.md reports): fault to exception, or to
    # the CLI's exit (a worker's start is on top).
    within_s: float = 60.0
    close_error: str | None = None  # API: close() also fails, naming this
    close_s: float = 30.0  # API: the longest close after the fault (a bound on a hang, as within_s)
    surfaces: tuple[str, ...] = (API, CLI)
    settle_s: float = 5.0
    extra_lines: int = 0  # CLI: lines after the cause (close could not stop a stream)
    timeout_s: float = CALM_TIMEOUT_S  # engine.timeout_s

    @property
    def run_overrides(self) -> tuple[str, ...]:
        return (f"engine.timeout_s={self.timeout_s:g}", *self.overrides)


STALLED = r"(waited 1 s for event 'step\d+\.end' on stream 'compute'|did not complete within 1 s)"
FAULTS = [
    Fault("forward-inproc", "an exception in a model forward", "forward@30",
          r"stream 'compute' failed in launch of .*InjectedFault: injected fault at 'forward'", error=(DeviceError,)),
    Fault("forward-shm", "an exception in a model forward", "forward@30",
          r"worker rank 0 \(pid \d+\) stopped: .*InjectedFault: injected fault at 'forward'", SHM, (WorkerDied,)),
    Fault("capture-inproc", "an exception in graph capture", "capture",
          r"InjectedFault: injected fault at 'capture'|^injected fault at 'capture'", error=(faults.InjectedFault,)),
    Fault("capture-shm", "an exception in graph capture", "capture",
          r"worker rank 0 \(pid \d+\) stopped: InjectedFault: injected fault at 'capture'", SHM, (WorkerDied,)),
    Fault("submission-thread", "an exception on the submission thread", "submit@5",
          r"InjectedFault: injected fault at 'submit'|^injected fault at 'submit'", error=(faults.InjectedFault,)),
    Fault("polling-thread", "an exception in the polling thread", "poll@5",
          r"worker rank 0 \(pid \d+\) stopped: InjectedFault: injected fault at 'poll'", SHM, (WorkerDied,)),
    Fault("sigkill-worker", "a worker process killed with SIGKILL", KILL,
          r"worker rank 0 \(pid \d+\) was killed by SIGKILL", SHM, (WorkerDied,)),
    Fault("sigint-inproc", "SIGINT to the main process mid-run", "SIGINT", "^corelib: interrupted$",
          exit_code=130, surfaces=(CLI,)),
    Fault("sigint-shm", "SIGINT to the main process mid-run", "SIGINT", "^corelib: interrupted$", SHM,
          exit_code=130, surfaces=(CLI,)),
    Fault("sigterm-inproc", "SIGTERM to the main process mid-run", "SIGTERM", r"^corelib: terminated \(SIGTERM\)$",
          exit_code=143, surfaces=(CLI,)),
    Fault("sigterm-shm", "SIGTERM to the main process mid-run", "SIGTERM", r"^corelib: terminated \(SIGTERM\)$", SHM,
          exit_code=143, surfaces=(CLI,)),
    # The stalled closure cannot be interrupted: close says which stream it could not stop,
    # and the thread ends when the closure returns.
    Fault("stalled-stream-inproc", "a stalled device stream (emulator)", f"forward@30:stall={STALL_S:g}", STALLED,
          error=(DeviceError, DeviceTimeout), close_error="could not stop streams 'compute'", timeout_s=TIMEOUT_S,
          settle_s=STALL_S + 5.0, extra_lines=1),
    Fault("stalled-stream-shm", "a stalled device stream (emulator)", "forward@30:stall",
          rf"{STALLED}|waited 1 s for the tokens of step \d+ from worker rank 0", SHM, (TransportError, WorkerDied),
          timeout_s=TIMEOUT_S),
    # The scheduler names the worker that stopped and how far it got: waiting for room in the
    # ring, or (the worker answers the tokens of a step in the same loop) for those tokens.
    Fault("full-ring", "a full SHM ring (a worker that stops consuming)", "poll@5:stall",
          r"waited 1 s for (worker rank 0 to release slot 0 of input ring \(frame \d+\)|the tokens of step \d+ from "
          r"worker rank 0 on result ring); frames released: worker rank 0: \d+ of \d+ sent",
          (*SHM, "engine.shm.num_slots=1"), (TransportError,), timeout_s=TIMEOUT_S),
]
CASES = [pytest.param(f, s, id=f"{f.name}-{s}") for f in FAULTS for s in f.surfaces]
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14] * 20, [15, 16], [17, 18, 19]]
LONG_RUN_REQUESTS = 200


def _error_lines(text: str) -> list[str]:
    """The lines that say why the run stopped (status lines, also on stderr, left out)."""
    stopped = ("corelib: error:", "corelib: interrupted", "corelib: terminated")
    return [line for line in text.splitlines() if line.startswith(stopped)]


# ---------------------------------------------------------------------------------- the API


def _fail_through_api(fault: Fault, finished: list[str]) -> tuple[BaseException, Engine | None, float]:
    """Run requests until the fault stops the engine; the error, the engine, seconds from the fault."""
    engine: Engine | None = None
    armed = time.monotonic()
    try:
        engine = Engine.from_overrides([*SMALL, *fault.run_overrides])
        for prompt in PROMPTS:
            engine.add_request(prompt, SamplingParams(max_tokens=200, ignore_eos=True))
        steps = 0
        while engine.has_unfinished:
            finished += [o.request_id for o in engine.step()]
            steps += 1
            if steps == 5 and fault.inject == KILL:
                executor = engine.core.executor
                assert isinstance(executor, ShmExecutor), "the kill needs worker processes"
                os.kill(executor.ranks[0].process.pid, signal.SIGKILL)
                armed = time.monotonic()
    except fault.error as error:
        return error, engine, time.monotonic() - armed
    raise AssertionError(f"{fault.name}: the engine finished every request; the fault never fired")


def check_api(fault: Fault, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = "" if fault.inject == KILL else fault.inject
    monkeypatch.setenv(faults.ENV, spec)  # for the workers this test starts
    before = Holdings.now()
    finished: list[str] = []
    with faults.injected(spec):
        error, engine, elapsed = _fail_through_api(fault, finished)
    message = str(error)
    assert re.search(fault.message, message), f"{fault.name}: the error does not name the cause: {message}"
    assert "\n" not in message, f"{fault.name}: a multi-line error: {message}"
    assert elapsed < fault.within_s, f"{fault.name}: {elapsed:.1f} s from the fault to the error"
    closing = 0.0
    if engine is not None:
        assert not engine.has_unfinished, f"{fault.name}: requests were left unfinished"
        ended = engine.take_finished()
        assert all(o.finish_reason == "error" and o.error for o in ended), ended
        assert len(finished) + len(ended) == len(PROMPTS), f"{fault.name}: a request got no output"
        with pytest.raises(RuntimeError, match="stopped after an error"):
            engine.step()
        started = time.monotonic()
        if fault.close_error is None:
            engine.close()
        else:
            with pytest.raises(DeviceTimeout, match=fault.close_error):
                engine.close()
        closing = time.monotonic() - started
        assert closing < fault.close_s, f"{fault.name}: close took {closing:.1f} s"
        del engine
    left = settled(before, within=fault.settle_s)
    assert not left, f"{fault.name}: left behind {left}"
    print(f"\n{fault.name}: {type(error).__name__} {elapsed:.2f} s after the fault, closed in {closing:.2f} s")


# ---------------------------------------------------------------------------------- the CLI


class Watcher:
    """Reads the CLI's output as it comes; notes when the progress bar shows a run half done."""

    PROGRESS = re.compile(r"(\d+)/(\d+) requests")  # the decoding bar, not the startup ones (weights, graphs)

    def __init__(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None and process.stderr is not None, "Popen was asked for pipes"
        self.process = process
        self.mid_run = threading.Event()
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.workers: set[int] = set()
        # The progress bar is status: it draws on stderr.
        self._threads = [threading.Thread(target=self._read, args=(process.stdout, self.stdout, False)),
                         threading.Thread(target=self._read, args=(process.stderr, self.stderr, True))]
        for thread in self._threads:
            thread.start()

    def _read(self, stream: IO[str], into: list[str], progress: bool) -> None:
        # The progress bar redraws with carriage returns: read characters, not lines.
        while chunk := stream.read(256):
            into.append(chunk)
            if progress and not self.mid_run.is_set():
                done = [(int(a), int(b)) for a, b in self.PROGRESS.findall("".join(into)[-2000:])]
                if any(0 < a < b for a, b in done):
                    self.mid_run.set()

    def wait(self, until: threading.Event | None, timeout: float) -> bool:
        """Note worker processes while waiting for ``until`` (or for the exit); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.workers |= children(self.process.pid)
            if (until is not None and until.is_set()) or self.process.poll() is not None:
                return True
            time.sleep(0.02)
        return False

    def finish(self) -> tuple[str, str]:
        for thread in self._threads:
            thread.join(10)
        return "".join(self.stdout), "".join(self.stderr)


def hermetic_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in HERMETIC_VARIABLES}


def start_long_run(
    overrides: tuple[str, ...], run_dir: Path, env: dict[str, str]
) -> tuple[subprocess.Popen[str], Watcher]:
    """``python -m corelib run`` with enough work to be interrupted mid-way, and a Watcher on it."""
    env = {**env, "FORCE_COLOR": "1"}  # the progress bar draws on a pipe too: it tells when the run is mid-way
    workload = [f"workload.num_requests={LONG_RUN_REQUESTS}", "workload.output_len_min=100",
                "workload.output_len_max=200"]
    command = [sys.executable, "-m", "corelib", "run", *SMALL, *overrides, *workload, f"hydra.run.dir={run_dir}"]
    process = subprocess.Popen(command, cwd=run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    return process, Watcher(process)


def check_cli(fault: Fault, tmp_path: Path) -> None:
    env = hermetic_env()
    if fault.inject not in SIGNALS and fault.inject != KILL:
        env[faults.ENV] = fault.inject
    run_dir = tmp_path / "run"
    process, watcher = start_long_run(fault.run_overrides, run_dir, env)
    try:
        armed = time.monotonic()
        if fault.inject in SIGNALS or fault.inject == KILL:
            assert watcher.wait(watcher.mid_run, 120), "the run did not get going within 120 s"
            assert watcher.mid_run.is_set(), f"the run ended before the fault: {watcher.finish()}"
            if fault.inject == KILL:
                assert watcher.workers, "no worker process was seen"
                os.kill(min(watcher.workers), signal.SIGKILL)
            else:
                process.send_signal(SIGNALS[fault.inject])
            armed = time.monotonic()
        bound = fault.within_s + (0 if fault.inject in SIGNALS or fault.inject == KILL else 60)  # + interpreter start
        exited = watcher.wait(None, bound)
        elapsed = time.monotonic() - armed
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)
    _, stderr = watcher.finish()
    assert exited, f"{fault.name}: still running {bound:.0f} s after the fault; stderr:\n{stderr}"
    assert process.returncode == fault.exit_code, f"{fault.name}: exit {process.returncode}; stderr:\n{stderr}"
    assert "Traceback" not in stderr, stderr
    lines = _error_lines(stderr)
    named = bool(lines) and re.search(fault.message, lines[0])
    assert named, f"{fault.name}: the first line does not name the cause:\n{stderr}"
    assert len(lines) == 1 + fault.extra_lines, f"{fault.name}: expected {1 + fault.extra_lines} line(s):\n{stderr}"
    outputs = run_dir / "outputs.jsonl"  # written as requests finish: the finished ones stay
    finished = len(read_outputs(outputs)) if outputs.exists() else 0
    assert finished < LONG_RUN_REQUESTS, f"{fault.name}: the run completed before the fault"
    if fault.inject in SIGNALS and "engine.transport=shm" in fault.overrides:
        assert watcher.workers, f"{fault.name}: no worker was seen, so none could be checked"
    deadline = time.monotonic() + 5.0
    while any(is_running(pid) for pid in watcher.workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in watcher.workers if is_running(pid)]
    assert not alive, f"{fault.name}: worker processes {alive} outlived the run"
    assert not segments(process.pid), f"{fault.name}: segments left: {segments(process.pid)}"
    print(f"\n{fault.name}: exit {process.returncode} {elapsed:.2f} s after the fault: {lines[0]}")


@pytest.fixture(autouse=True)
def _disarmed() -> Iterator[None]:
    yield
    assert not faults._armed, "a test left a fault armed in this process"


@pytest.mark.slow
@pytest.mark.long  # a fresh interpreter and a worker per CLI fault, stalls that must time out
@pytest.mark.parametrize(("fault", "surface"), CASES)
def test_fault(fault: Fault, surface: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if surface == API:
        check_api(fault, monkeypatch)
    else:
        check_cli(fault, tmp_path)


def test_the_table_covers_every_required_fault() -> None:
    wanted = {
        "an exception in a model forward", "an exception in graph capture", "an exception on the submission thread",
        "an exception in the polling thread", "a worker process killed with SIGKILL",
        "SIGINT to the main process mid-run", "SIGTERM to the main process mid-run",
        "a stalled device stream (emulator)", "a full SHM ring (a worker that stops consuming)",
    }
    assert {f.what for f in FAULTS} == wanted
    assert all(CLI in f.surfaces for f in FAULTS), "every fault must also end the CLI cleanly"


def test_a_malformed_fault_list_is_refused() -> None:
    with pytest.raises(ValueError, match=r"cannot read 'forwrd@2'"):
        faults.parse("forwrd@2")
    assert faults.parse("forward@3:stall=0.5, poll") == {
        "forward": faults.Fault("forward", 3, 0.5), "poll": faults.Fault("poll", 1, None)}


def test_a_gate_holds_the_chosen_arrival_until_released_and_no_other() -> None:
    passed: list[int] = []

    def arrive(times: int) -> None:
        for number in range(1, times + 1):
            faults.maybe_fail("forward")
            passed.append(number)

    with faults.gate("forward", hit=2) as held:
        worker = threading.Thread(target=arrive, args=(3,))
        worker.start()
        assert held.reached.wait(10)
        assert passed == [1], "the second arrival must be held, the first not"
        held.release()
        worker.join(10)
    assert passed == [1, 2, 3]
    with faults.gate("forward", timeout_s=0.01), pytest.raises(faults.InjectedFault, match="not released"):
        faults.maybe_fail("forward")
    faults.maybe_fail("forward")  # the gate is gone with its block


def test_a_hold_says_it_holds_and_waits_for_its_release_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert faults.parse("poll@2:hold") == {"poll": faults.Fault("poll", 2, None, hold=True)}
    with pytest.raises(ValueError, match="not for seconds"):
        faults.parse("forward:hold=3")
    release = tmp_path / "release"
    monkeypatch.setenv(faults.RELEASE_ENV, str(release))  # what a process the test starts inherits
    passed: list[int] = []

    def arrive() -> None:
        for number in (1, 2, 3):
            faults.maybe_fail("forward")
            passed.append(number)

    held = Path(f"{release}.held")
    with faults.injected("forward@2:hold"):
        worker = threading.Thread(target=arrive)
        worker.start()
        deadline = time.monotonic() + 10
        while not held.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held.exists(), "the second arrival never said it was held"
        assert passed == [1] and worker.is_alive(), "the second arrival must be held, the first not"
        release.touch()
        worker.join(10)
    assert passed == [1, 2, 3]



@pytest.mark.slow
@pytest.mark.long
def test_sigkill_to_the_main_process_ends_its_workers_and_the_next_start_removes_its_segments(tmp_path: Path) -> None:
    """The one signal nothing can catch: the workers notice their scheduler is gone and exit, and
    the segments it could not unlink are removed (and reported) by the next run that uses SHM."""
    env = hermetic_env()
    process, watcher = start_long_run(SHM, tmp_path / "a", env)
    try:
        assert watcher.wait(watcher.mid_run, 120) and watcher.mid_run.is_set(), "the run did not get going"
        assert watcher.workers, "no worker process was seen"
        left = segments(process.pid)
        assert left, "the run holds no SHM segment"
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        killed = time.monotonic()
    finally:
        if process.poll() is None:
            process.kill()
        watcher.finish()
    while any(is_running(pid) for pid in watcher.workers) and time.monotonic() - killed < 5.0:
        time.sleep(0.05)
    alive = [pid for pid in watcher.workers if is_running(pid)]
    assert not alive, f"workers {alive} outlived their scheduler by 5 s"
    orphaned_s = time.monotonic() - killed

    second = subprocess.run(
        [sys.executable, "-m", "corelib", "run", "backend=npu", *SHM, "workload.num_requests=2",
         f"hydra.run.dir={tmp_path / 'b'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert second.returncode == 0, second.stderr
    assert not segments(process.pid), f"still in /dev/shm: {segments(process.pid)}"
    # Under pytest-xdist another test's engine may have swept them first; alone, this run did.
    said = "shared-memory segment(s) left by a run that crashed" in second.stdout
    assert said or os.environ.get("PYTEST_XDIST_WORKER"), f"the next run did not say what it removed:\n{second.stdout}"
    print(f"\nsigkill-main: workers gone {orphaned_s:.2f} s after the kill; the next run removed {sorted(left)}")


@pytest.mark.slow
def test_the_segments_a_crashed_run_left_are_reported_at_the_next_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from corelib.transport import shm_executor as transport

    monkeypatch.setattr(transport, "sweep_stale", lambda: ["corelib-99999-0badf00d-in", "corelib-99999-0badf00d-out"])
    with Engine.from_overrides(["backend=cpu", *SHM]) as engine:
        assert engine.notices[0] == ("removed 2 shared-memory segment(s) left by a run that crashed: "
                                     "corelib-99999-0badf00d-in, corelib-99999-0badf00d-out")
