"""Chunked prefill in the scheduler, on the CPU with no device: decode rows first, then chunks of
prompts under the token budget; a chunk short of its prompt's end samples nothing, and the relay
never feeds a row from a step that did not sample for it."""

from __future__ import annotations

import dataclasses

import pytest

from corelib.engine.block_manager import BlockManager
from corelib.engine.scheduler import ScheduledStep, Scheduler, SchedulerLimits
from corelib.engine.sequence import SamplingParams, Sequence
from corelib.engine.stops import StopChecker
from corelib.step.arena import RELAY
from corelib.testing.executor import UNSAMPLED, scripted_core, unit_config, unit_options

BUDGET = 8


def scheduler(budget: int = BUDGET, num_blocks: int = 64, max_seqs: int = 4) -> Scheduler:
    return Scheduler(SchedulerLimits(max_seqs, budget, 256, chunked_prefill=True), BlockManager(num_blocks, 4),
                     max_seqs, StopChecker(256, frozenset({1})))


def seq(i: int, prompt_len: int, max_tokens: int = 16) -> Sequence:
    return Sequence(i, f"r{i}", [10 + (i * 7 + j) % 50 for j in range(prompt_len)],
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(s: Scheduler, in_flight: bool = False) -> ScheduledStep:
    out = s.schedule(in_flight=in_flight, sync_check=lambda seqs: [])
    assert isinstance(out, ScheduledStep), out
    return out


def test_decode_rows_come_first_and_a_chunk_fills_what_the_budget_leaves() -> None:
    s = scheduler()
    a, b = seq(0, 3), seq(1, 3)
    s.add(a)
    s.add(b)
    s.postprocess(step(s), [20, 21])  # both prompts fit one step: each samples its first token
    long = seq(2, 30)
    s.add(long)
    mixed = step(s)
    assert mixed.seqs == [a, b, long], "the decode rows first, then the new prompt"
    assert mixed.query_lens == [1, 1, BUDGET - 2] and mixed.num_tokens == BUDGET
    assert mixed.samples == [True, True, False], "the chunk does not reach the prompt's end"
    assert long.num_computed_tokens == BUDGET - 2 and long.num_pending == 0


def test_a_prompt_is_fed_in_chunks_and_only_its_last_chunk_samples() -> None:
    s = scheduler()
    long = seq(0, 19)
    s.add(long)
    chunks = []
    while not long.output_token_ids:
        current = step(s)
        chunks.append((current.starts[0], current.query_lens[0], current.samples[0]))
        s.postprocess(current, [UNSAMPLED if not current.samples[0] else 33])
    assert chunks == [(0, 8, False), (8, 8, False), (16, 3, True)]
    assert long.output_token_ids == [33], "the tokens of the rows that sampled nothing were never taken"


def test_every_step_stays_within_the_token_budget_and_every_block_comes_back() -> None:
    s = scheduler(budget=12, num_blocks=40)
    for i, length in enumerate((30, 5, 17, 1, 44, 9)):
        s.add(seq(i, length, max_tokens=6))
    while s.has_unfinished:
        current = step(s)
        assert current.num_tokens <= 12, current.query_lens
        assert len(set(map(id, current.seqs))) == len(current.seqs), "a sequence appears once per step"
        s.postprocess(current, [40 if sampled else UNSAMPLED for sampled in current.samples])
    assert s.blocks.num_free_blocks == 39 and not s.running


def _relay_feeds(run_ahead: int, budget: int) -> tuple[dict[str, list[int]], int]:
    """Tokens of a workload on the scripted device, and the RELAY inputs that followed a row that sampled."""
    config = unit_config(max_num_seqs=3, max_model_len=64)
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, max_num_batched_tokens=budget))
    options = dataclasses.replace(unit_options(run_ahead=run_ahead), chunked_prefill=budget < 64)
    core, executor = scripted_core(config, options)
    prompts = [list(range(2, 2 + n)) for n in (21, 3, 13, 30)]
    for i, prompt in enumerate(prompts):
        core.scheduler.add(Sequence(i, str(i), prompt, SamplingParams(max_tokens=5, ignore_eos=True)))
    while core.iterate():
        pass
    relays = 0
    sampled: dict[int, bool] = {}  # state index -> the last step that held it sampled for it
    for submitted in executor.submitted:
        fi, v = submitted.fi, submitted.views
        for row in range(fi.num_seqs):
            last = row if fi.is_decode else int(v["query_start"][row + 1]) - 1
            state = int(v["state_indices"][row])
            if int(v["input_ids"][last]) == RELAY:
                assert sampled.get(state), f"step {fi.step_id} feeds row {row} from the relay after a step that " \
                    "sampled nothing for it"
                relays += 1
            sampled[state] = int(v["sample_slots"][row]) == state
    outputs = {seq.request_id: seq.output_token_ids for seq in core.take_finished()}
    return outputs, relays


@pytest.mark.parametrize("run_ahead", [1, 2])
def test_the_relay_feeds_only_rows_whose_previous_step_sampled_and_tokens_stay_those_of_whole_prompts(
        run_ahead: int) -> None:
    expected, _ = _relay_feeds(run_ahead=0, budget=64)
    got, relays = _relay_feeds(run_ahead=run_ahead, budget=5)
    assert relays > 0, "async handoff was meant to feed decode rows from the relay"
    assert got == expected
