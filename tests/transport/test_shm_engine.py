"""The engine over SHM: same tokens as in-process, nothing left behind, failures named."""

from __future__ import annotations

import os
import select
import signal

import pytest
import torch
from ringkit import RecordingPoller

from corelib.engine import Engine, SamplingParams
from corelib.errors import WorkerDied
from corelib.step.fields import step_layout
from corelib.step.forward_input import ForwardInput
from corelib.transport import doorbell
from corelib.transport.shm import PREFIX, SHM_DIR
from corelib.transport.shm_executor import ShmExecutor

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7], list(range(10, 40)), [100] * 5, list(range(200, 217)), [3, 4], [9] * 12]
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 33, 5, 1, 40, 9)]


def our_segments() -> set[str]:
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(f"{PREFIX}-{os.getpid()}-")}


def tokens(overrides: list[str]) -> list[list[int]]:
    with Engine.from_overrides(overrides) as engine:
        return [o.output_token_ids for o in engine.generate(PROMPTS, PARAMS)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(["backend=cpu"], id="cpu"),
        pytest.param(["backend=npu", "backend.emulator.chaos=0.3"], id="npu-auto-ordered"),
        pytest.param(["backend=cuda", "backend.runtime=emulated", "backend.emulator.chaos=0.3"], id="cuda-auto-early"),
        pytest.param(["backend=mlu", "backend.emulator.chaos=0.3", "engine.async_token_handoff=off"],
                     id="mlu-sync"),
        pytest.param(["backend=cuda", "backend.runtime=native"], id="cuda-native",
                     marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")]),
    ],
)
def test_shm_tokens_equal_inproc(overrides: list[str]) -> None:
    before = our_segments()
    assert tokens([*overrides, "engine.transport=shm"]) == tokens(overrides)
    assert our_segments() == before, "segments were left behind"


def test_on_the_cpu_the_scheduler_runs_ahead_of_the_worker_with_the_tokens_of_in_process() -> None:
    # shm_overlap: step N+1 is packed and shipped while the worker computes step N, its tokens from the worker's
    # relay; sampled rows (seeded) and a row with a stop string (its steps run synchronously) among them.
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8 if i % 2 else 0.0, seed=i)
              for i, n in enumerate((20, 33, 5, 1, 40, 9))]
    params[2] = SamplingParams(max_tokens=12, ignore_eos=True, stop=["never printed"])
    deepest = 0
    outputs: dict[str, list[int]] = {}
    with Engine.from_overrides(["backend=cpu", "engine.transport=shm"]) as engine:
        assert engine.core.pipeline.run_ahead == 1 and not engine.async_handoff
        ids = [engine.add_request(prompt, sampling) for prompt, sampling in zip(PROMPTS, params, strict=True)]
        while engine.has_unfinished:
            outputs |= {o.request_id: o.output_token_ids for o in engine.step()}
            deepest = max(deepest, engine.core.num_in_flight)
    assert deepest == 1, "the scheduler never left a step in flight while it scheduled the next"
    ahead = [outputs[i] for i in ids]
    with Engine.from_overrides(["backend=cpu"]) as engine:
        assert [o.output_token_ids for o in engine.generate(PROMPTS, params)] == ahead
    with Engine.from_overrides(["backend=cpu", "engine.transport=shm", "engine.shm.overlap=off"]) as engine:
        assert engine.core.pipeline.run_ahead == 0
        assert [o.output_token_ids for o in engine.generate(PROMPTS, params)] == ahead


def test_a_killed_worker_is_named_quickly_and_nothing_leaks(monkeypatch: pytest.MonkeyPatch) -> None:
    # No periodic liveness check, and every wait's poll recorded: the death must end a wait
    # through the worker's closed pipe (or be seen between waits), never by a wait running out.
    monkeypatch.setattr(doorbell, "CHECK_S", 3600.0)
    pollers: list[RecordingPoller] = []

    def recording_poll() -> RecordingPoller:
        pollers.append(RecordingPoller(plain_poll()))
        return pollers[-1]

    plain_poll = select.poll
    monkeypatch.setattr(select, "poll", recording_poll)  # the module the waiters call
    before = our_segments()
    engine = Engine.from_overrides(["backend=npu", "engine.transport=shm", "engine.timeout_s=3600"])
    executor = engine.core.executor
    assert isinstance(executor, ShmExecutor)
    pid = executor.ranks[0].process.pid
    for i in range(4):
        engine.add_request([i + 2, i + 3], SamplingParams(max_tokens=500, ignore_eos=True))
    for _ in range(5):
        engine.step()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerDied, match=rf"worker rank 0 \(pid {pid}\) was killed by SIGKILL"):
        while engine.has_unfinished:
            engine.step()
    assert pollers, "no wait of the transport was recorded"
    timed_out = [events for poller in pollers for events in poller.returned if not events]
    assert not timed_out, "a wait ran out before the dead worker was noticed"
    engine.close()
    assert executor.ranks[0].process.poll() is not None
    assert our_segments() == before


def test_a_corrupt_frame_stops_the_engine_naming_the_frame() -> None:
    # A payload's bytes are checked with the payload CRC only (the header's CRC covers its length).
    engine = Engine.from_overrides(["backend=cpu", "engine.transport=shm", "engine.shm.payload_crc=true"])
    executor = engine.core.executor
    assert isinstance(executor, ShmExecutor)

    def flip(header: object, payload: torch.Tensor) -> None:
        if getattr(header, "seq", 0) == 3:
            payload[10] ^= 0x01

    executor.producer.tamper = flip
    with pytest.raises(WorkerDied, match=r"input ring \(rank 0\) frame 3 \(slot 3\): bad checksum"):
        engine.generate(PROMPTS, PARAMS)
    engine.close()


def test_segments_of_a_crashed_run_are_removed_and_reported() -> None:
    # Any engine starting meanwhile (another test process) sweeps the same directory and may
    # take the leftover first; then this one has nothing to report, and the test tries again.
    # The name is this process's own: another suite running this test at once writes its own.
    for attempt in range(5):
        leftover = SHM_DIR / f"{PREFIX}-{2**22 + 777}-cafe{os.getpid():x}0{attempt}-in"
        leftover.write_bytes(b"\0" * 4096)
        with Engine.from_overrides(["backend=cpu", "engine.transport=shm"]) as engine:
            reported = any(leftover.name in notice for notice in engine.notices)
        assert not leftover.exists()
        if reported:
            return
    pytest.fail("no engine of five reported the segment it removed")


def test_the_cpu_backend_reads_each_frame_in_its_ring_slot_until_the_step_is_done() -> None:
    from corelib.config.options import Staging
    from corelib.plugins import PluginRegistry
    from corelib.startup.compose import compose_config
    from corelib.startup.start import start
    from corelib.step.staging import HostStager, build_stager

    startup = start(compose_config(["backend=cpu", "engine.transport=shm"]), PluginRegistry())
    options = startup.options
    assert options.staging is Staging.host
    with startup.backend.open(startup.spec) as device:
        stager = build_stager(options.staging, device, device.stream("compute"), 1024, 2, 1.0)
        assert isinstance(stager, HostStager), "the cpu device reads its inputs where they are: no device copy"
        slot = torch.zeros(8192, dtype=torch.uint8)
        layout = step_layout(1, 1, 1)
        fi = ForwardInput(0, 1, 1, 1, 1, 1, False, layout, slot)
        released: list[bool] = []
        staged = stager.receive(fi, lambda: released.append(True))
        assert staged.source.data_ptr() == slot.data_ptr(), "the step reads the slot itself: no snapshot"
        assert stager.to_device(staged, None).data_ptr() == slot.data_ptr()
        assert not released, "the slot went back while the step may still read it"
        staged.release()
        staged.release()
        assert released == [True], "the slot goes back once, when the step is done"
        assert device.memory_stats().pinned_bytes == 0


@pytest.mark.long  # three SHM engines, one after the other
def test_running_two_steps_ahead_over_shm_gives_the_tokens_of_one_ahead_and_of_sync() -> None:
    base = ["backend=npu", "backend.emulator.chaos=0.2", "engine.transport=shm"]
    deepest = 0
    with Engine.from_overrides([*base, "engine.async_token_handoff=on", "engine.run_ahead=2"]) as engine:
        assert engine.core.pipeline.depth == 3
        ids = [engine.add_request(prompt, params) for prompt, params in zip(PROMPTS, PARAMS, strict=True)]
        outputs: dict[str, list[int]] = {}
        while engine.has_unfinished:
            outputs |= {o.request_id: o.output_token_ids for o in engine.step()}
            deepest = max(deepest, engine.core.num_in_flight)
        two_ahead = [outputs[i] for i in ids]
    # Between two calls, the steps submitted and not yet read: run_ahead of them.
    assert deepest == 2, f"at most {deepest} steps were left in flight: the scheduler never ran two steps ahead"
    assert two_ahead == tokens([*base, "engine.async_token_handoff=on", "engine.run_ahead=1"])
    assert two_ahead == tokens([*base, "engine.async_token_handoff=off"])


def test_an_idle_engine_notices_a_dead_worker() -> None:
    engine = Engine.from_overrides(["backend=cpu", "engine.transport=shm"])
    executor = engine.core.executor
    assert isinstance(executor, ShmExecutor)
    engine.check_alive()  # all well: nothing raised
    pid = executor.ranks[0].process.pid
    os.kill(pid, signal.SIGKILL)
    executor.ranks[0].process.wait()
    with pytest.raises(WorkerDied, match=rf"worker rank 0 \(pid {pid}\) was killed by SIGKILL"):
        engine.check_alive()
    assert not engine.has_unfinished
    engine.close()
