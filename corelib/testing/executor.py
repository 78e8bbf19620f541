"""A scripted executor: the engine's loop with no model and no device, for unit tests on the CPU.

It plays the device's part: a token whose input id is ``RELAY`` reads its slot's latest sample,
as the token handoff's relay does; each row's token comes from ``next_token`` of its last input
token and goes to the relay slot the row names (a row that samples nothing names the padding
slot; its token is ``UNSAMPLED``, which no host may read as a token); a step's inputs are the
"device's" until its tokens are read, when it calls the loop's release callback.
It records what happened, in order (``log``): each submission (with a copy of the packed inputs
in ``submitted``), each result read, and each time an arena went back to the pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from corelib.config.options import EngineOptions, Staging, StepCheck
from corelib.config.schema import BackendConfig, CorelibConfig, EngineConfig, ModelConfig, Transport, WorkloadConfig
from corelib.engine.build import build_engine_core
from corelib.engine.core import EngineCore
from corelib.platform.device import MemoryStats
from corelib.step.arena import RELAY, ArenaPool
from corelib.step.forward_input import ForwardInput
from corelib.step.handoff import StepResult
from corelib.step.layout import EngineLayout
from corelib.transport.executor import SPARE_ARENAS, Executor, StepFuture

NextToken = Callable[[int, int], int]  # (previous token, its position) -> the token sampled after it
UNSAMPLED = 10**9  # the token a row that samples nothing returns: out of every vocabulary


def count_up(vocab_size: int) -> NextToken:
    """The default script: each token is the previous one plus one, modulo the vocabulary."""
    return lambda previous, position: (previous + 1) % vocab_size


@dataclass(frozen=True)
class Submitted:
    """One step as the loop packed it: its shape and a copy of its input views."""

    fi: ForwardInput
    views: dict[str, torch.Tensor]


class ScriptedExecutor(Executor):
    """Answers each step with scripted tokens; ``log`` says what happened, in order."""

    def __init__(self, layout: EngineLayout, depth: int, next_token: NextToken, timeout_s: float = 10.0) -> None:
        self.arenas = _LoggedPool(self, layout.arena_bytes, depth + SPARE_ARENAS, timeout_s)
        self._arena_steps: dict[int, int] = {}  # an arena's address -> the step last packed into it
        self.notices = []
        self.next_token = next_token
        self.relay = [0] * (layout.rows + 1)  # per state slot: the latest sample (the last slot pads)
        self.submitted: list[Submitted] = []
        self.log: list[tuple[str, int]] = []  # ("submit" | "result" | "release", step id)
        self.closed = False

    def submit(self, fi: ForwardInput, release: Callable[[], None]) -> StepFuture:
        views = {name: view.clone() for name, view in fi.views().items()}
        self.submitted.append(Submitted(fi, views))
        self.log.append(("submit", fi.step_id))
        self._arena_steps[fi.arena.data_ptr()] = fi.step_id
        return _Future(self, StepResult(fi.step_id, fi.kind, self._run(fi, views)), release)

    def _run(self, fi: ForwardInput, views: dict[str, torch.Tensor]) -> list[int]:
        pad = len(self.relay) - 1
        tokens = []
        for row in range(fi.num_seqs):
            last = row if fi.is_decode else int(views["query_start"][row + 1]) - 1
            slot = int(views["state_indices"][row])
            given = int(views["input_ids"][last])
            previous = self.relay[slot] if given == RELAY else given
            token = self.next_token(previous, int(views["positions"][last]))
            sample_slot = int(views["sample_slots"][row])
            if sample_slot == pad:
                token = UNSAMPLED
            self.relay[sample_slot] = token
            tokens.append(token)
        return tokens

    def memory_stats(self) -> list[MemoryStats]:
        return [MemoryStats(0, 0, 0)]

    def close(self, timeout: float) -> None:
        self.closed = True


class _LoggedPool(ArenaPool):
    """The executor's arena pool, logging each arena's return with the step last packed into it."""

    def __init__(self, executor: ScriptedExecutor, nbytes: int, count: int, timeout_s: float) -> None:
        super().__init__(lambda shape, dtype: torch.zeros(shape, dtype=dtype), nbytes, count, timeout_s)
        self._executor = executor

    def release(self, arena: torch.Tensor) -> None:
        step = self._executor._arena_steps.pop(arena.data_ptr(), None)
        if step is not None:
            self._executor.log.append(("release", step))
        super().release(arena)


class _Future(StepFuture):
    def __init__(self, executor: ScriptedExecutor | None, result: StepResult, release: Callable[[], None]) -> None:
        self._executor = executor
        self._result = result
        self._release: Callable[[], None] | None = release

    def result(self, timeout: float) -> StepResult:
        if self._release is not None:
            if self._executor is not None:
                self._executor.log.append(("result", self._result.step_id))
            release, self._release = self._release, None
            release()  # the "device" is done with the inputs once its tokens are read
        return self._result


class InstantExecutor(Executor):
    """Answers every step at once with one fixed token per row, copying nothing: the host's side of a
    step measured (or counted) alone, as if the device took no time."""

    def __init__(self, layout: EngineLayout, depth: int, token: int = 7, timeout_s: float = 10.0) -> None:
        self.arenas = ArenaPool(lambda shape, dtype: torch.zeros(shape, dtype=dtype), layout.arena_bytes,
                                depth + SPARE_ARENAS, timeout_s)
        self.notices = []
        self.token = token
        self.steps = 0

    def submit(self, fi: ForwardInput, release: Callable[[], None]) -> StepFuture:
        self.steps += 1
        return _Future(None, StepResult(fi.step_id, fi.kind, [self.token] * fi.num_seqs), release)

    def memory_stats(self) -> list[MemoryStats]:
        return [MemoryStats(0, 0, 0)]

    def close(self, timeout: float) -> None:
        return None


def unit_config(max_num_seqs: int = 4, block_size: int = 4, max_model_len: int = 64, vocab_size: int = 64,
                num_kv_blocks: int = 0, eos_token_id: int = 1) -> CorelibConfig:
    """A small config built directly (no Hydra, no plugins): for loop units that need no model."""
    model = ModelConfig(name="unit", vocab_size=vocab_size, max_model_len=max_model_len, eos_token_id=eos_token_id)
    engine = EngineConfig(max_num_seqs=max_num_seqs, block_size=block_size, num_kv_blocks=num_kv_blocks)
    return CorelibConfig(backend=BackendConfig(name="cpu"), model=model, engine=engine, workload=WorkloadConfig())


def unit_options(run_ahead: int = 0, step_check: StepCheck | None = None, timeout_s: float = 10.0) -> EngineOptions:
    """Options as startup would decide them for an in-process engine without graphs (``run_ahead`` > 0: async)."""
    return EngineOptions(graphs=False, lazy_capture=False, async_handoff=run_ahead > 0, run_ahead=run_ahead,
                         transport=Transport.inproc, tp=1, fast_allreduce=False, staging=Staging.inline, fused_ops=(),
                         pdl=False,
                         attention_reads_live_blocks_only=False, compile=False, timeout_s=timeout_s,
                         step_check=step_check or StepCheck())


def instant_core(config: CorelibConfig, options: EngineOptions) -> tuple[EngineCore, InstantExecutor]:
    """The request loop around an executor that answers at once: only the host's work per step is left."""
    layout = EngineLayout.of(config)
    executor = InstantExecutor(layout, options.pipeline_depth)
    return build_engine_core(config, options, layout, executor), executor


def scripted_core(config: CorelibConfig | None = None, options: EngineOptions | None = None,
                  next_token: NextToken | None = None) -> tuple[EngineCore, ScriptedExecutor]:
    """The request loop around a scripted executor: no device, no model, milliseconds per step."""
    config = config or unit_config()
    options = options or unit_options()
    layout = EngineLayout.of(config)
    executor = ScriptedExecutor(layout, options.pipeline_depth, next_token or count_up(config.model.vocab_size))
    return build_engine_core(config, options, layout, executor), executor
