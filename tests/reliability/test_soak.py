"""The soak: mixed traffic on emulated npu with chaos on, async handoff and SHM ordered.

Outside the default test run: ``pytest -m soak``. ``CORELIB_SOAK_SECONDS`` sets how long
requests keep arriving (default 120). Afterwards every request's tokens are compared with a
synchronous in-process engine on the cpu backend, greedy, and the memory samples taken while
it ran must be flat after a warm-up of WARMUP_S:

- pinned host bytes never change;
- device bytes (the fixed pools plus the inputs of the step in flight, which vary with the
  batch) never rise more than DEVICE_SLACK above the warm-up's highest;
- the resident memory of the scheduler and of the worker grows by less than RSS_BOUND, and
  its least-squares slope stays under SLOPE_BOUND per minute.

``CORELIB_SOAK_REPORT`` names a JSON file for the figures (what the README's table quotes).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from leakkit import Holdings, settled
from soakkit import Sample, frequent_token, read_outputs, reference, run_soak, slope_per_minute

SECONDS = float(os.environ.get("CORELIB_SOAK_SECONDS", "120"))
WARMUP_S = min(60.0, SECONDS / 4)  # allocator pools, lazy imports and the metrics windows fill up first
RSS_BOUND = 16 << 20  # growth after the warm-up, scheduler and worker each
SLOPE_BOUND = 1 << 20  # bytes per minute, after the warm-up, scheduler and worker each
DEVICE_SLACK = 64 << 10  # a batch's inputs larger than any during the warm-up


def _growth(samples: list[Sample], value: Callable[[Sample], int]) -> dict[str, Any]:
    """How ``value`` moved: at the start, its highest during the warm-up, after it, and its slope then."""
    warmup = [s for s in samples if s.at_s < WARMUP_S] or samples[:1]
    steady = [s for s in samples if s.at_s >= WARMUP_S] or samples[-1:]
    mib = 2**20
    return {
        "start_mib": round(value(samples[0]) / mib, 3),
        "warmup_max_mib": round(max(value(s) for s in warmup) / mib, 3),
        "steady_first_mib": round(value(steady[0]) / mib, 3),
        "steady_max_mib": round(max(value(s) for s in steady) / mib, 3),
        "end_mib": round(value(samples[-1]) / mib, 3),
        "growth_after_warmup_mib": round((max(value(s) for s in steady) - value(steady[0])) / mib, 3),
        "slope_mib_per_min": round(slope_per_minute(steady, value) / mib, 4),
    }


@pytest.mark.soak
def test_soak_tokens_match_and_memory_stays_flat(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    eos = frequent_token()
    before = Holdings.now()
    with capsys.disabled():
        result = run_soak(SECONDS, eos, max(1.0, SECONDS / 240), tmp_path / "outputs.jsonl",
                          log=lambda line: print(line, flush=True))
    left = settled(before, within=10.0)
    outputs = read_outputs(tmp_path / "outputs.jsonl")
    expected = reference(sorted(outputs), eos)
    differing = sorted(i for i, tokens in outputs.items() if tokens != expected[i])
    scheduler = _growth(result.samples, lambda s: s.scheduler_rss)
    worker = _growth(result.samples, lambda s: s.worker_rss)
    device = _growth(result.samples, lambda s: s.device_bytes)
    pinned = sorted({s.pinned_bytes for s in result.samples})
    report = {
        "seconds": round(result.seconds, 1),
        "warmup_s": WARMUP_S,
        "requests": len(outputs),
        "output_tokens": sum(len(t) for t in outputs.values()),
        "finish_reasons": result.finish_reasons,
        "steps": result.steps,
        "steps_sync": result.steps_sync,
        "preemptions": result.preemptions,
        "token_mismatches": len(differing),
        "samples": len(result.samples),
        "pinned_bytes": pinned,
        "device": device,
        "scheduler_rss": scheduler,
        "worker_rss": worker,
        "left_behind": left,
    }
    with capsys.disabled():
        print("\nsoak:", json.dumps(report, indent=1), flush=True)
    if path := os.environ.get("CORELIB_SOAK_REPORT"):
        Path(path).write_text(json.dumps(report, indent=1) + "\n")

    assert len(outputs) == result.requests > 0, "the soak finished no request, or lost some"
    assert result.preemptions > 0 and result.steps_sync > 0, "the traffic never preempted or fell back to sync"
    assert not differing, f"{len(differing)} requests differ from the synchronous reference, first {differing[:5]}"
    assert not left, f"the soak left behind {left}"
    assert len(pinned) == 1, f"pinned bytes changed: {pinned}"
    assert (device["steady_max_mib"] - device["warmup_max_mib"]) * 2**20 <= DEVICE_SLACK, f"device bytes rose: {device}"
    for name, figures in (("scheduler", scheduler), ("worker", worker)):
        assert figures["growth_after_warmup_mib"] * 2**20 < RSS_BOUND, f"{name} RSS grew: {figures}"
        assert figures["slope_mib_per_min"] * 2**20 < SLOPE_BOUND, f"{name} RSS keeps growing: {figures}"
