"""The second seed's race: early materialization corrupts inputs, ordered materialization does not.

On the emulated npu profile (a non-blocking H2D reads its source when it runs, and chaos
delays the polling stream) the early path must show corruption: that proves the harness can
see the race. The ordered path must show none over 5000 steps. On a GPU the same pair of
outcomes appears once the SHM region is host-registered (pinned), so the copy reads late.
"""

from __future__ import annotations

import pytest
import torch
from racekit import race

NPU_CHAOS = ["backend=npu", "backend.emulator.chaos=0.5", "backend.emulator.chaos_max_ms=0.3",
             "backend.emulator.seed=3"]


def test_early_materialization_is_corrupted_on_the_npu_profile() -> None:
    assert race(NPU_CHAOS, ordered=False, steps=300) > 0, "the harness did not see the race it exists to show"


@pytest.mark.slow
def test_ordered_materialization_has_no_mismatch_over_5000_steps() -> None:
    assert race(NPU_CHAOS, ordered=True, steps=5000) == 0


@pytest.mark.slow
def test_ordered_materialization_reading_the_registered_slot_in_place_has_no_mismatch_over_5000_steps() -> None:
    # No snapshot: the H2D reads the ring slot, which goes back only once that copy has run.
    assert race(NPU_CHAOS, ordered=True, steps=5000, in_place=True) == 0


def test_ordered_in_place_over_a_ring_of_one_slot() -> None:
    # Every frame lands in the slot of the one before: the producer waits until the H2D has read it.
    assert race(NPU_CHAOS, ordered=True, steps=300, num_slots=1, in_place=True) == 0


@pytest.mark.slow
def test_early_on_the_cuda_profile_is_safe_with_pageable_memory() -> None:
    # cuda stages a pageable source when the copy is issued: the early path keeps working there
    assert race(["backend=cuda", "backend.runtime=emulated", "backend.emulator.chaos=0.5",
                 "backend.emulator.chaos_max_ms=0.3"], ordered=False, steps=300) == 0


def test_early_over_a_registered_ring_races_on_the_cuda_profile_too() -> None:
    # engine.shm.register_host: the copy reads the registered slot when it runs, so the race shows on cuda too
    assert race(["backend=cuda", "backend.runtime=emulated", "backend.emulator.chaos=0.5",
                 "backend.emulator.chaos_max_ms=0.3", "backend.emulator.seed=3"], ordered=False, steps=300,
                register_host=True) > 0


def _busy_polling_stream(device: object, stream: object) -> None:
    # The polling stream of a real engine has work queued; a sleep kernel of a few ms stands in
    # for it, so the copy runs after the producer had time to rewrite the released slot.
    with torch.cuda.stream(stream.native):  # type: ignore[attr-defined]
        torch.cuda._sleep(5_000_000)  # type: ignore[no-untyped-call]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize(("ordered", "in_place"), [(False, False), (True, False), (True, True)],
                         ids=["early", "ordered-snapshot", "ordered-in-place"])
def test_host_registered_shm_on_a_gpu(ordered: bool, in_place: bool) -> None:
    mismatches = race(["backend=cuda", "backend.runtime=native"], ordered=ordered, steps=5000 if ordered else 200,
                      register_host=True, widen=_busy_polling_stream, in_place=in_place)
    if ordered:
        assert mismatches == 0
    else:
        assert mismatches > 0, "host-registered SHM read late by the early H2D should show corruption"
