"""The host's work per decode step grows slowly with the batch: counted in calls and tensor ops, never timed.

The loop runs around an executor that answers at once (no device, no model), so all that is
left of a step is the scheduler side's own work: schedule, pack, post-process. A Python-level
profiler counts the function calls each of those makes per step, and a torch function mode
counts the tensor operations; the difference between a large and a small batch, per added row,
is what the bounds below hold. A per-row tensor op, a per-row re-evaluation of a request's
facts, or a detokenization per token would each break one.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from types import FrameType
from typing import Any

import pytest
from torch.overrides import TorchFunctionMode

from corelib.engine.core import EngineCore
from corelib.engine.sequence import SamplingParams, Sequence
from corelib.testing.executor import instant_core, unit_config, unit_options

# The phase a call belongs to: the outermost of these functions on the stack.
PHASES = {"schedule": "schedule", "fill": "pack", "postprocess": "postprocess"}
# Calls per added row per step, at most. Schedule: the continue check and the decode row (KV slot,
# position, relay flag); pack: the row's cached state and its input id; post-process: the token
# appended and one stop pre-check.
PER_ROW_CALLS = {"schedule": 9, "pack": 8, "postprocess": 3}
SMALL, LARGE = 16, 128


class _CountOps(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def _core(batch: int, stop_strings: tuple[str, ...] = ()) -> EngineCore:
    config = unit_config(max_num_seqs=LARGE, block_size=16, max_model_len=256, vocab_size=1000)
    config.engine.graph_batch_sizes = [1, 8, SMALL, 64, LARGE]
    config.engine.max_num_batched_tokens = 32 * LARGE
    core, _ = instant_core(config, dataclasses.replace(unit_options(run_ahead=1), graphs=True))
    for number in range(batch):
        prompt = [(number * 131 + j * 17) % 900 + 2 for j in range(32)]
        sampling = SamplingParams(max_tokens=64, ignore_eos=True, stop=stop_strings)
        core.add(Sequence(number, f"r{number}", prompt, sampling))
    for _ in range(4):  # the prefill, then decode steps until the pipeline is full
        core.iterate()
    return core


def count_steps(core: EngineCore, steps: int) -> tuple[Counter[str], int]:
    """Calls per phase and tensor ops over ``steps`` decode steps."""
    calls: Counter[str] = Counter()
    stack: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            phase = PHASES.get(frame.f_code.co_name) if not stack else None
            if phase is not None:
                stack.append(phase)
                return
        if event == "return" and stack and PHASES.get(frame.f_code.co_name) == stack[0] and len(stack) == 1:
            stack.pop()
            return
        if stack and event in ("call", "c_call"):
            calls[stack[0]] += 1

    ops = _CountOps()
    with ops:
        sys.setprofile(profile)
        try:
            for _ in range(steps):
                core.iterate()
        finally:
            sys.setprofile(None)
    return calls, ops.count


def per_row(stop_strings: tuple[str, ...] = ()) -> tuple[dict[str, float], float]:
    steps = 6
    small, small_ops = count_steps(_core(SMALL, stop_strings), steps)
    large, large_ops = count_steps(_core(LARGE, stop_strings), steps)
    rows = (LARGE - SMALL) * steps
    return {phase: (large[phase] - small[phase]) / rows for phase in PER_ROW_CALLS}, (large_ops - small_ops) / steps


def test_the_host_step_grows_by_a_few_calls_per_row_and_no_tensor_ops() -> None:
    calls, ops = per_row()
    assert ops == 0, f"{ops:g} more tensor ops per step at bs {LARGE} than at bs {SMALL}: a per-row op crept in"
    for phase, bound in PER_ROW_CALLS.items():
        assert calls[phase] <= bound, f"{phase}: {calls[phase]:.1f} calls per added row per step (at most {bound})"
    assert all(calls[phase] > 0 for phase in PER_ROW_CALLS), f"the profiler saw no per-row work: {calls}"


@pytest.mark.parametrize("phase", ["postprocess"])
def test_a_text_stop_check_is_per_row_work_the_plain_path_does_not_pay(phase: str) -> None:
    # The same loop with stop strings on every request runs the text check for every row: the
    # bound above only holds because rows without one skip it.
    plain, _ = per_row()
    texts, _ = per_row(stop_strings=("\n\n",))
    assert texts[phase] > PER_ROW_CALLS[phase] >= plain[phase]
