"""Ordered SHM materialization end to end: the engine's tokens on the emulated npu equal the cpu's.

The npu profile's host-to-device copy reads its source when the prepare stream runs it, late
under chaos. The npu registers host memory, so ordered materialization's copy reads the ring
slot itself, which goes back to the producer only once that copy has run; given back any
earlier, the late copy would read whatever the scheduler packed into the slot next. The
frames' CRC covers their payloads here too (``engine.shm.payload_crc``).

Running one step ahead, the scheduler has at most two steps in flight and reads a step's
tokens before writing the step after next, so with two ring slots a step's slot is reused
only once its step is done; the race needs a frame between two steps. Two ways a real run
gets one, each tested:

- ``engine.memory_stats()`` between steps (how a server samples memory while requests run):
  each such frame shifts the ring by one, so the next step lands in the slot of the step
  still in flight;
- a ring of one slot: every step lands in the slot of the one before.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence

import pytest

from corelib.engine import Engine, SamplingParams

ORDERED_NPU = [
    "backend=npu",
    "backend.runtime=emulated",
    "backend.emulator.chaos=0.5",
    "backend.emulator.chaos_max_ms=2.0",
    "backend.emulator.seed=11",
    "engine.transport=shm",
    "engine.shm.materialization=ordered",
    "engine.shm.payload_crc=true",
    "engine.async_token_handoff=on",
    "engine.max_num_seqs=8",
]

Request = tuple[list[int], SamplingParams]


def mixed_requests(count: int, seed: int) -> list[Request]:
    """Greedy and seeded sampled requests of different lengths (sampling is batch-independent)."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        prompt = [rng.randrange(2, 512) for _ in range(rng.randint(1, 30))]
        max_tokens = 1 if i % 7 == 3 else rng.randint(8, 40)
        if i % 3 == 2:
            sampling = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
        else:
            sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        requests.append((prompt, sampling))
    return requests


REQUESTS = mixed_requests(14, seed=5)


def run(overrides: Sequence[str], requests: list[Request], sample_memory: bool) -> list[list[int]]:
    """Half the requests up front, the rest two at a time while steps are in flight."""
    outputs: dict[str, list[int]] = {}
    with Engine.from_overrides(list(overrides)) as engine:
        pending = list(enumerate(requests))
        first = len(pending) // 2
        for index, (prompt, sampling) in pending[:first]:
            engine.add_request(prompt, sampling, request_id=str(index))
        pending = pending[first:]
        iterations = 0
        while pending or engine.has_unfinished:
            if pending and iterations % 5 == 4:
                for index, (prompt, sampling) in pending[:2]:
                    engine.add_request(prompt, sampling, request_id=str(index))
                pending = pending[2:]
            for out in engine.step():
                assert out.finish_reason == "length", f"request {out.request_id}: {out.finish_reason} ({out.error})"
                outputs[out.request_id] = out.output_token_ids
            if sample_memory:
                engine.memory_stats()
            iterations += 1
    return [outputs[str(i)] for i in range(len(requests))]


@functools.cache
def cpu_tokens() -> tuple[tuple[int, ...], ...]:
    """The tokens of a synchronous in-process cpu run: no streams, no copies, nothing to race."""
    tokens = run(["backend=cpu", "engine.max_num_seqs=8"], REQUESTS, sample_memory=False)
    return tuple(tuple(t) for t in tokens)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ring", "sample_memory"),
    [
        pytest.param(["engine.shm.num_slots=2"], True, id="two-slots-memory-sampled"),
        pytest.param(["engine.shm.num_slots=1"], False, id="one-slot"),
    ],
)
def test_ordered_shm_tokens_equal_the_cpu_under_chaos(ring: list[str], sample_memory: bool) -> None:
    expected = [list(tokens) for tokens in cpu_tokens()]
    assert sum(len(tokens) for tokens in expected) > 200, "the workload was meant to have many decode steps"
    assert run([*ORDERED_NPU, *ring], REQUESTS, sample_memory) == expected
