"""Prompt points of `python -m corelib bench`: time to first token for ``count`` prompts of ``length`` tokens.

Each point sends ``count`` fresh prompts of ``length`` tokens at once (no prefix the cache could
hold) with one new token each, after a warm-up of the same shape; its time to first token is the
time until the last of them has its token, the median over the repeats, and its prompt
throughput is the prompt tokens over that time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from rich.table import Table

from corelib.engine.api import Engine
from corelib.engine.sequence import SamplingParams


@dataclass
class PromptPoint:
    label: str  # the engine it ran on (backend, transport, handoff, ops)
    length: int  # prompt tokens each
    count: int  # prompts sent at once
    ttft_ms: float  # until the last prompt's first token, median over the repeats
    prompt_tokens_per_s: float
    repeats_ms: list[float]
    steps: int  # engine steps the prompts took, in the last repeat


def measure_prompts(engine: Engine, label: str, length: int, count: int, repeats: int) -> PromptPoint:
    """One point: a warm-up of the same shape, then ``repeats`` timed sends of ``count`` fresh prompts."""
    times: list[float] = []
    steps = 0
    for repeat in range(repeats + 1):
        prompts = _prompts(engine.vocab_size, length, count, seed=repeat)
        first = engine.stats().num_steps
        started = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        if repeat:  # the first send is the warm-up
            times.append((time.perf_counter() - started) * 1e3)
            steps = engine.stats().num_steps - first
    ttft = statistics.median(times)
    return PromptPoint(label, length, count, ttft, length * count / ttft * 1e3, times, steps)


def _prompts(vocab: int, length: int, count: int, seed: int) -> list[list[int]]:
    """``count`` prompts that share no block with each other or with another seed's (no prefix cache hits)."""
    return [[(seed * 104729 + i * 7919 + j * 31 + j * j) % (vocab - 2) + 2 for j in range(length)]
            for i in range(count)]


def prompt_table(points: list[PromptPoint]) -> Table:
    table = Table(title="corelib bench: time to first token (prompts sent at once, one new token each)")
    for column in ("engine", "prompts x tokens", "TTFT ms", "prompt tok/s", "steps"):
        table.add_column(column, justify="right")
    for p in points:
        table.add_row(p.label, f"{p.count} x {p.length}", f"{p.ttft_ms:.2f}", f"{p.prompt_tokens_per_s:,.0f}",
                      str(p.steps))
    return table
