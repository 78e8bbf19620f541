"""Start/stop cycles of the engine (20 in process, 8 with an SHM worker by default) leave nothing behind.

Each cycle builds an engine (emulated npu, async handoff), runs a tiny workload, checks its
tokens and closes it. After every cycle this process holds no thread, child process, SHM
segment or file descriptor that it did not hold before the first; every byte the in-process
device handed out is back once the engine is dropped; and over all cycles the devices hold
the same bytes while running and the host's resident memory grows by less than RSS_BOUND.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
import weakref
from dataclasses import dataclass

import pytest
from leakkit import Holdings, rss_bytes, settled

from corelib.engine import Engine, SamplingParams
from corelib.platform.device import Device, MemoryStats

# CORELIB_CYCLES=50: the count docs/reliability.md reports. By default fewer with a worker: its
# start (a fresh interpreter) is most of a cycle, and each cycle is checked on its own anyway.
CYCLES = {"inproc": 20, "shm": 8}
if "CORELIB_CYCLES" in os.environ:
    CYCLES = dict.fromkeys(CYCLES, int(os.environ["CORELIB_CYCLES"]))
RSS_BOUND = 24 << 20  # host RSS growth over all cycles, after one warm-up cycle (measured: < 3 MiB)
CLOSE_BOUND_S = 5.0  # one close, workers included (measured: < 0.1 s in process, ~0.6 s with a worker)
OVERRIDES = ["backend=npu", "engine.async_token_handoff=on", "engine.max_num_seqs=4", "model.max_model_len=64"]
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (8, 1, 5)]


@dataclass(frozen=True)
class Cycle:
    tokens: list[list[int]]
    memory: list[MemoryStats]  # while the engine runs
    device: weakref.ref[Device] | None  # the in-process device, to check it is freed
    start_s: float
    run_s: float
    close_s: float


def cycle(transport: str) -> Cycle:
    started = time.perf_counter()
    engine = Engine.from_overrides([*OVERRIDES, f"engine.transport={transport}"])
    built = time.perf_counter()
    tokens = [o.output_token_ids for o in engine.generate(PROMPTS, PARAMS)]
    memory = engine.memory_stats()
    device = weakref.ref(engine.local_device) if engine.startup.config.engine.transport.value == "inproc" else None
    ran = time.perf_counter()
    engine.close()
    closed = time.perf_counter()
    return Cycle(tokens, memory, device, built - started, ran - built, closed - ran)


def device_released(ref: weakref.ref[Device] | None) -> str | None:
    """None when the in-process device is gone or holds nothing; else what it still holds."""
    gc.collect()
    device = ref() if ref is not None else None
    if device is None:
        return None
    stats = device.memory_stats()
    if stats == MemoryStats(0, 0, 0):
        return None
    return f"{stats} (referrers: {[type(r).__name__ for r in gc.get_referrers(device)]})"


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("transport", ["inproc", "shm"])
def test_start_stop_cycles_leave_nothing_behind(transport: str) -> None:
    warm = cycle(transport)  # one-time costs (lazy imports, thread pools, caches) belong to the baseline
    assert [len(t) for t in warm.tokens] == [8, 1, 5]
    assert device_released(warm.device) is None
    before = Holdings.now()
    rss_start = rss_bytes()
    cycles: list[Cycle] = []
    for index in range(CYCLES[transport]):
        done = cycle(transport)
        cycles.append(done)
        assert done.tokens == warm.tokens, f"cycle {index}: different tokens"
        assert done.memory == warm.memory, f"cycle {index}: the devices hold {done.memory}, the first {warm.memory}"
        assert done.close_s < CLOSE_BOUND_S, f"cycle {index}: close took {done.close_s:.2f} s"
        left = settled(before, within=5.0)
        assert not left, f"cycle {index} left {left}"
        held = device_released(done.device)
        assert held is None, f"cycle {index}: the device still holds {held} after the engine was dropped"
    growth = rss_bytes() - rss_start
    total = sum(c.start_s + c.run_s + c.close_s for c in cycles)
    start, run, close = (statistics.median(getattr(c, f) for c in cycles) for f in ("start_s", "run_s", "close_s"))
    print(
        f"\n{transport}: {CYCLES[transport]} cycles in {total:.1f} s; median start {start:.3f} s, run {run:.3f} s,"
        f" close {close:.3f} s (max {max(c.close_s for c in cycles):.3f}); device bytes"
        f" {[m.device_bytes for m in warm.memory]}, pinned {[m.pinned_bytes for m in warm.memory]} each cycle,"
        f" 0 after; RSS {rss_start / 2**20:.1f} -> {(rss_start + growth) / 2**20:.1f} MiB"
    )
    assert growth < RSS_BOUND, f"host RSS grew by {growth / 2**20:.1f} MiB over {CYCLES[transport]} cycles"
