"""The soak: mixed traffic for a set time, its memory sampled as it runs, its tokens checked afterwards.

Traffic: requests arrive while steps are in flight (a few every iteration, in bursts), with
prompts of 1 to 40 tokens, outputs of 1 to 100 tokens (every ninth is max_tokens=1), an EOS
token that the model often samples, a KV pool small enough to force preemption, and every
41st request with a host-side stop string and every 59th flagged multimodal, so the steps
that carry them fall back to the synchronous path. Request ``i`` is the same in every run, so a
reference engine can replay exactly the requests the soak ran.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from leakkit import rss_bytes

from corelib.engine import Engine, SamplingParams
from corelib.transport.shm_executor import ShmExecutor

POOL = ["engine.max_num_seqs=6", "engine.num_kv_blocks=24", "model.max_model_len=160"]
WINDOW = ["engine.metrics_window=1000"]  # the engine's figures fill their windows within seconds
EOS = 0  # replaced by the token the model samples most (see frequent_token)
CHAOS = ["backend.emulator.chaos=0.2", "backend.emulator.chaos_max_ms=0.5"]


def soak_overrides(eos: int) -> list[str]:
    return ["backend=npu", *CHAOS, "engine.async_token_handoff=on", "engine.transport=shm",
            "engine.shm.materialization=ordered", *POOL, *WINDOW, f"model.eos_token_id={eos}"]


def reference_overrides(eos: int) -> list[str]:
    return ["backend=cpu", "engine.async_token_handoff=off", *POOL, f"model.eos_token_id={eos}"]


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    sampling: SamplingParams
    multimodal: bool


def request(index: int, eos: int) -> Request:
    rng = random.Random(index * 7919 + 17)
    prompt = [t for t in (rng.randrange(2, 512) for _ in range(rng.randint(1, 40))) if t != eos] or [2]
    max_tokens = 1 if index % 9 == 0 else rng.randint(2, 100)
    stops = ("<never>",) if index % 41 == 5 else ()
    return Request(prompt, SamplingParams(max_tokens=max_tokens, stop=stops), index % 59 == 3)


def frequent_token() -> int:
    """The token a plain greedy run samples most: as EOS it ends many requests early."""
    with Engine.from_overrides(["backend=cpu", *POOL]) as probe:
        outputs = probe.generate([request(i, -1).prompt for i in range(24)],
                                 SamplingParams(max_tokens=30, ignore_eos=True))
    counts: dict[int, int] = {}
    for output in outputs:
        for token in output.output_token_ids:
            counts[token] = counts.get(token, 0) + 1
    return max(counts, key=lambda t: counts[t])


@dataclass
class Sample:
    at_s: float
    scheduler_rss: int
    worker_rss: int
    device_bytes: int
    pinned_bytes: int


@dataclass
class SoakResult:
    seconds: float
    requests: int  # finished, each a line of the outputs file
    finish_reasons: dict[str, int]
    samples: list[Sample]
    steps: int
    steps_sync: int
    preemptions: int


def read_outputs(path: Path) -> dict[int, list[int]]:
    """Request index -> tokens, from the file run_soak wrote."""
    outputs: dict[int, list[int]] = {}
    with path.open() as lines:
        for line in lines:
            index, tokens = json.loads(line)
            outputs[index] = tokens
    return outputs


def run_soak(seconds: float, eos: int, sample_every_s: float, outputs_path: Path,
             log: Callable[[str], None] = print) -> SoakResult:
    """Drive the soak engine for ``seconds`` of arrivals, then drain; sample memory as it goes.

    Each finished request is appended to ``outputs_path`` as ``[index, tokens]``, so the soak's
    own bookkeeping does not grow the memory it measures.
    """
    done = 0
    reasons: dict[str, int] = {}
    samples: list[Sample] = []
    rng = random.Random(2024)
    with outputs_path.open("w") as out, Engine.from_overrides(soak_overrides(eos)) as engine:
        executor = engine.core.executor
        assert isinstance(executor, ShmExecutor), "the soak runs over SHM"
        worker = executor.ranks[0].process.pid
        started = time.monotonic()
        next_sample = started
        added = 0

        def sample() -> None:
            (memory,) = engine.memory_stats()
            samples.append(Sample(time.monotonic() - started, rss_bytes(), rss_bytes(worker),
                                  memory.device_bytes, memory.pinned_bytes))

        while True:
            now = time.monotonic()
            arriving = now - started < seconds
            if not arriving and not engine.has_unfinished:
                break
            # Arrivals between steps: async handoff keeps a step in flight across this call.
            if arriving and len(engine.scheduler.waiting) < 12:
                for _ in range(rng.choice((0, 0, 1, 1, 2, 4))):
                    req = request(added, eos)
                    engine.add_request(req.prompt, req.sampling, request_id=str(added), multimodal=req.multimodal)
                    added += 1
            for output in engine.step():
                out.write(json.dumps([int(output.request_id), output.output_token_ids]) + "\n")
                done += 1
                reasons[output.finish_reason] = reasons.get(output.finish_reason, 0) + 1
            if now >= next_sample:
                sample()
                next_sample = now + sample_every_s
                if len(samples) % 12 == 1:
                    last = samples[-1]
                    log(f"soak {last.at_s:7.1f} s: {added} requests, {done} done, scheduler RSS "
                        f"{last.scheduler_rss / 2**20:.1f} MiB, worker RSS {last.worker_rss / 2**20:.1f} MiB, "
                        f"device {last.device_bytes} B, pinned {last.pinned_bytes} B")
        sample()
        summary = engine.metrics(time.monotonic() - started)
        preemptions = engine.scheduler.num_preemptions
    return SoakResult(time.monotonic() - started, done, reasons, samples, summary["steps"], summary["steps_sync"],
                      preemptions)


def reference(indices: list[int], eos: int) -> dict[int, list[int]]:
    """Greedy tokens of the same requests from a synchronous in-process engine on the cpu backend."""
    with Engine.from_overrides(reference_overrides(eos)) as engine:
        reqs = [request(i, eos) for i in indices]
        outputs = engine.generate([r.prompt for r in reqs], [r.sampling for r in reqs],
                                  multimodal=[r.multimodal for r in reqs])
    return {i: o.output_token_ids for i, o in zip(indices, outputs, strict=True)}


def slope_per_minute(samples: list[Sample], value: Callable[[Sample], int]) -> float:
    """Least-squares growth of ``value`` in bytes per minute."""
    xs = [s.at_s / 60 for s in samples]
    ys = [float(value(s)) for s in samples]
    if len(xs) < 2 or len(set(xs)) < 2:
        return 0.0
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    num = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    den = sum((x - mean_x) ** 2 for x in xs)
    return num / den
