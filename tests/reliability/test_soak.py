"""The soak: mixed traffic on emulated npu with chaos on, async handoff and SHM ordered.

Outside the default test run: ``pytest -m soak``. ``CORELIB_SOAK_SECONDS`` sets how long
requests keep arriving (default 120; the published run used 1200). Afterwards every request's
tokens are compared with a synchronous in-process engine on the cpu backend, greedy, and the
memory samples taken while it ran must be flat:

- the bytes each device holds (device and pinned) never change after the first sample;
- the resident memory of the scheduler and of the worker, after a warm-up of WARMUP_S, grows
  by less than RSS_BOUND and its least-squares slope stays under SLOPE_BOUND per minute.

``CORELIB_SOAK_REPORT`` names a JSON file for the figures (what the README's table quotes).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from leakkit import Holdings, settled
from soakkit import Sample, frequent_token, reference, run_soak, slope_per_minute

SECONDS = float(os.environ.get("CORELIB_SOAK_SECONDS", "120"))
WARMUP_S = min(60.0, SECONDS / 4)  # allocator pools, lazy imports and caches fill up first
RSS_BOUND = 32 << 20  # growth after the warm-up, scheduler and worker each
SLOPE_BOUND = 1 << 20  # bytes per minute, after the warm-up, scheduler and worker each


def _rss_figures(samples: list[Sample], value: Callable[[Sample], int]) -> dict[str, float]:
    steady = [s for s in samples if s.at_s >= WARMUP_S] or samples[-2:]
    base = value(steady[0])
    return {
        "start_mib": value(samples[0]) / 2**20,
        "after_warmup_mib": base / 2**20,
        "end_mib": value(samples[-1]) / 2**20,
        "growth_after_warmup_mib": (max(value(s) for s in steady) - base) / 2**20,
        "slope_mib_per_min": slope_per_minute(steady, value) / 2**20,
    }


@pytest.mark.soak
def test_soak_tokens_match_and_memory_stays_flat(capsys: pytest.CaptureFixture[str]) -> None:
    eos = frequent_token()
    before = Holdings.now()
    with capsys.disabled():
        result = run_soak(SECONDS, eos, sample_every_s=max(1.0, SECONDS / 240), log=lambda line: print(line, flush=True))
    left = settled(before, within=10.0)
    expected = reference(sorted(result.outputs), eos)
    differing = sorted(i for i, tokens in result.outputs.items() if tokens != expected[i])
    tokens = sum(len(t) for t in result.outputs.values())
    scheduler = _rss_figures(result.samples, lambda s: s.scheduler_rss)
    worker = _rss_figures(result.samples, lambda s: s.worker_rss)
    device_bytes = sorted({s.device_bytes for s in result.samples})
    pinned_bytes = sorted({s.pinned_bytes for s in result.samples})
    report = {
        "seconds": round(result.seconds, 1),
        "requests": len(result.outputs),
        "output_tokens": tokens,
        "finish_reasons": result.finish_reasons,
        "steps": result.steps,
        "steps_sync": result.steps_sync,
        "preemptions": result.preemptions,
        "token_mismatches": len(differing),
        "samples": len(result.samples),
        "device_bytes": device_bytes,
        "pinned_bytes": pinned_bytes,
        "scheduler_rss": scheduler,
        "worker_rss": worker,
        "left_behind": left,
    }
    with capsys.disabled():
        print("\nsoak:", json.dumps(report, indent=1), flush=True)
    if path := os.environ.get("CORELIB_SOAK_REPORT"):
        Path(path).write_text(json.dumps(report, indent=1) + "\n")

    assert result.outputs, "the soak finished no request"
    assert result.preemptions > 0 and result.steps_sync > 0, "the traffic never preempted or fell back to sync"
    assert not differing, f"{len(differing)} requests differ from the synchronous reference, first {differing[:5]}"
    assert not left, f"the soak left behind {left}"
    assert len(device_bytes) == 1 and len(pinned_bytes) == 1, f"device {device_bytes}, pinned {pinned_bytes} bytes"
    for name, figures in (("scheduler", scheduler), ("worker", worker)):
        assert figures["growth_after_warmup_mib"] * 2**20 < RSS_BOUND, f"{name} RSS grew: {figures}"
        assert figures["slope_mib_per_min"] * 2**20 < SLOPE_BOUND, f"{name} RSS keeps growing: {figures}"
