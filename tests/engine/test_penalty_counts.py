"""The penalties' token counts, kept by state index as tokens arrive.

A sequence with a penalty that is new to its state index has its counts rebuilt once, from the
tokens its blocks hold (count_history); every sampled step then adds only the tokens it feeds
(count_fed_tokens). These tests read the counts themselves: those of a reused state index must be
its new sequence's alone, and the work of a decode step must not grow with the context.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from support import EngineFactory

import corelib.step.runner as runner_module
from corelib.engine import SamplingParams
from corelib.engine.block_manager import BlockManager
from corelib.engine.packing import InputBuilder
from corelib.engine.scheduler import ScheduledStep, Scheduler, SchedulerLimits
from corelib.engine.sequence import Sequence
from corelib.engine.stops import StopChecker
from corelib.ops import TokenHistory
from corelib.ops.sampling import count_fed_tokens, count_history
from corelib.step.forward_input import ForwardInput
from corelib.step.layout import EngineLayout
from corelib.step.runner import ModelRunner
from corelib.testing.executor import unit_config
from corelib.transport.wire import HEADER_BYTES, FrameHeader, input_header, input_of

ONE_ROW = ["backend=cpu", "engine.max_num_seqs=1", "engine.block_size=4", "model.max_model_len=64"]


def _runners(monkeypatch: pytest.MonkeyPatch) -> list[ModelRunner]:
    """The runners the engines of the test build, as they are built."""
    made: list[ModelRunner] = []
    init = ModelRunner.__init__

    def spy(self: ModelRunner, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(ModelRunner, "__init__", spy)
    return made


def _histogram(tokens: list[int], vocab: int) -> list[int]:
    return torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=vocab).tolist()


@pytest.mark.parametrize("caching", ["off", "on"])
def test_a_reused_state_index_counts_its_new_sequence_alone(monkeypatch: pytest.MonkeyPatch,
                                                            make_engine: EngineFactory, caching: str) -> None:
    # One row: every request takes state index 0 after the one before. A count left over from the
    # request before (its prompt, its outputs) would show in the next one's. With the prefix cache on,
    # the second prompt begins with the first's blocks: the rebuild counts them from the cache.
    runners = _runners(monkeypatch)
    engine = make_engine([*ONE_ROW, f"engine.prefix_caching={caching}"])
    [runner] = runners
    vocab = runner.output_counts.shape[1]
    first_prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    penalised = SamplingParams(max_tokens=6, ignore_eos=True, frequency_penalty=0.5, repetition_penalty=1.3)
    engine.generate([first_prompt], penalised)
    prompt = [*first_prompt[:8], 40, 41, 40]  # two whole blocks of 4 in common with the first
    [second] = engine.generate([prompt], penalised)
    outputs = second.output_token_ids
    # The last sampled token is never fed: the counts hold the prompt and every output but it.
    assert runner.prompt_counts[0].tolist() == _histogram(prompt, vocab)
    assert runner.output_counts[0].tolist() == _histogram(outputs[:-1], vocab)
    if caching == "on":
        assert engine.scheduler.blocks.stats.hit_tokens >= 8, "the second prompt was meant to hit the cache"


def test_a_decode_step_counts_its_fed_tokens_only(monkeypatch: pytest.MonkeyPatch,
                                                  make_engine: EngineFactory) -> None:
    # A long prompt, then decode steps: the counts are rebuilt once (when the request takes its state
    # index), and each decode step adds the one token it feeds, however long the context.
    rebuilt: list[int] = []  # the rows of each rebuild
    fed: list[int] = []  # the tokens each step adds
    def spy_rebuild(history: TokenHistory, *args: Any) -> None:
        rebuilt.append(history.states.numel())
        count_history(history, *args)

    def spy_fed(history: TokenHistory, tokens: torch.Tensor, *args: Any) -> None:
        fed.append(tokens.numel())
        count_fed_tokens(history, tokens, *args)

    monkeypatch.setattr(runner_module, "count_history", spy_rebuild)
    monkeypatch.setattr(runner_module, "count_fed_tokens", spy_fed)
    engine = make_engine([*ONE_ROW, "model.max_model_len=128"])
    prompt = [7 + i % 50 for i in range(100)]
    params = SamplingParams(max_tokens=8, ignore_eos=True, presence_penalty=0.8)
    [out] = engine.generate([prompt], params)
    assert len(out.output_token_ids) == 8
    assert rebuilt == [1], "the counts are rebuilt once, when the request takes its state index"
    assert fed == [len(prompt)] + [1] * 7, "the prompt's step adds its tokens, each decode step its one"


def test_greedy_steps_count_nothing(monkeypatch: pytest.MonkeyPatch, make_engine: EngineFactory) -> None:
    # Rows without a penalty cost nothing more: a greedy request's steps neither rebuild nor add.
    calls: list[str] = []

    def record(name: str) -> Callable[..., None]:
        return lambda *args: calls.append(name)

    monkeypatch.setattr(runner_module, "count_history", record("rebuild"))
    monkeypatch.setattr(runner_module, "count_fed_tokens", record("fed"))
    engine = make_engine(ONE_ROW)
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert calls == []


def test_the_packer_names_a_penalized_sequence_new_to_its_state_index_once_and_the_frame_carries_it() -> None:
    scheduler = Scheduler(SchedulerLimits(2, 64, 16), BlockManager(16, 4), 2, StopChecker(16, frozenset()))
    builder = InputBuilder(EngineLayout.of(unit_config(max_num_seqs=2, block_size=4, max_model_len=16)))
    penalised = SamplingParams(max_tokens=8, repetition_penalty=1.2)
    scheduler.add(Sequence(0, "plain", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.8, seed=1)))
    scheduler.add(Sequence(1, "penalised", [8, 9, 10], penalised))

    def pack(step: ScheduledStep) -> ForwardInput:
        arena = torch.zeros(1 << 16, dtype=torch.uint8)
        return builder.fill(0, step, arena, 2 if step.kind == "decode" else len(step.seqs), 1)

    steps = []
    for _ in range(2):  # the prompts, then a decode step
        step = scheduler.schedule(in_flight=False, sync_check=lambda seqs: [])
        assert isinstance(step, ScheduledStep)
        steps.append(pack(step))
        scheduler.postprocess(step, [11] * len(step.seqs))
    prefill, decode = steps
    assert (prefill.num_recounts, int(prefill.views()["recount_rows"][0])) == (1, 1), "the penalised row, once"
    assert decode.num_recounts == 0, "its state index counts its tokens already"
    buffer = memoryview(bytearray(HEADER_BYTES))
    header = input_header(prefill, sent_at=0.0)
    header.payload_len = prefill.layout.nbytes
    header.pack_into(buffer)
    received = input_of(FrameHeader.unpack_from(buffer, "test frame"), prefill.arena, "test frame")
    assert received.num_recounts == 1 and int(received.views()["recount_rows"][0]) == 1
