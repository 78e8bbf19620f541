"""A step with prompt tokens is packed token by token as a plain reading of the step says, whichever way the packer
writes it: a few rows of several tokens one by one, more of them as vectors over the step's tokens.

Each step holds decode rows first (one token each, some from the relay), then prompt rows: chunks of a prompt,
chunks that reach a sequence's outputs (a sequence recomputed after preemption), chunks whose last token is still on
the device, single tokens. The reference
reads each token's id, position and KV slot off the sequence and its block table.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from corelib.engine import token_fields
from corelib.engine.packing import InputBuilder
from corelib.engine.scheduler import ScheduledStep
from corelib.engine.sequence import SamplingParams, Sequence
from corelib.step.arena import RELAY
from corelib.step.layout import EngineLayout

ROWS, BLOCK, MAX_LEN = 12, 4, 96
LAYOUT = EngineLayout(
    rows=ROWS,
    block_size=BLOCK,
    max_blocks=MAX_LEN // BLOCK,
    num_blocks=ROWS * MAX_LEN // BLOCK + 1,
    max_model_len=MAX_LEN,
    max_batched_tokens=256,
    graph_batch_sizes=(1, 2, 4, 8),
)


def random_step(rng: random.Random, decoders: int, prompts: int, first_id: int = 0) -> ScheduledStep:
    """``decoders`` decode rows, then ``prompts`` rows of several tokens (or one), their blocks all distinct; the
    sequences numbered from ``first_id`` (each new to the packer, as a new request is)."""
    free = list(range(1, LAYOUT.num_blocks))
    rng.shuffle(free)
    step = ScheduledStep([], [], [], [], [])
    for row in range(decoders + prompts):
        prompt = [rng.randrange(2, 900) for _ in range(rng.randint(2, 60))]
        seq = Sequence(first_id + row, f"r{first_id + row}", prompt, SamplingParams(seed=row))
        seq.output_token_ids = [rng.randrange(2, 900) for _ in range(rng.randint(0, 20))]
        seq.state_index = row
        if row < decoders:  # its last token (one the host may not know yet: from the relay)
            relay = rng.random() < 0.5
            start, count = seq.num_tokens - (0 if relay else 1), 1
        else:  # a chunk; one that ends past the tokens the host knows feeds its last one from the relay
            start = rng.randrange(0, seq.num_tokens)
            relay = rng.random() < 0.2
            count = seq.num_tokens + 1 - start if relay else rng.randint(1, seq.num_tokens - start)
        seq.block_table = [free.pop() for _ in range(-(-(start + count) // BLOCK))]
        step.seqs.append(seq)
        step.starts.append(start)
        step.query_lens.append(count)
        step.samples.append(row < decoders)
        step.from_relay.append(relay)
    return step


def reference(step: ScheduledStep) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {"input_ids": [], "positions": [], "slot_mapping": [], "query_start": [0]}
    for seq, start, count, relay in zip(step.seqs, step.starts, step.query_lens, step.from_relay, strict=True):
        for position in range(start, start + count):
            last = position == start + count - 1
            out["input_ids"].append(RELAY if relay and last else seq.all_token_ids()[position])
            out["positions"].append(position)
            out["slot_mapping"].append(seq.block_table[position // BLOCK] * BLOCK + position % BLOCK)
        out["query_start"].append(out["query_start"][-1] + count)
    return out


@pytest.mark.parametrize("few_rows", [0, token_fields.FEW_ROWS, 1000], ids=["vectors", "default", "row-by-row"])
def test_every_token_is_packed_as_the_step_reads_whichever_way_it_is_written(
    few_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(token_fields, "FEW_ROWS", few_rows)
    rng = random.Random(few_rows)
    builder = InputBuilder(LAYOUT)
    arena = torch.zeros(LAYOUT.arena_bytes, dtype=torch.uint8)
    for trial in range(40):
        decoders, prompts = rng.randint(0, 6), rng.randint(1, 6)
        step = random_step(rng, decoders, prompts, first_id=100 * trial)
        fi = builder.fill(trial, step, arena, len(step.seqs), LAYOUT.max_blocks)
        views = fi.views()
        want = reference(step)
        tokens = step.num_tokens
        for name in ("input_ids", "positions", "slot_mapping"):
            assert views[name][:tokens].tolist() == want[name], (trial, name)
        if max(step.query_lens) > 1:  # (a step of single tokens is a decode step: token i is row i's)
            assert views["query_start"][: len(step.seqs) + 1].tolist() == want["query_start"], trial
            assert fi.decode_rows == next(row for row, count in enumerate(step.query_lens) if count > 1)


def test_a_padded_step_writes_the_same_tokens_and_pads_past_them() -> None:
    rng = random.Random(7)
    builder = InputBuilder(LAYOUT)
    arena = torch.full((LAYOUT.arena_bytes,), 0xAB, dtype=torch.uint8)  # whatever an earlier step left
    step = random_step(rng, 4, 2)
    padded = 256
    views = builder.fill(0, step, arena, ROWS, LAYOUT.max_blocks, padded).views()
    want, tokens, n = reference(step), step.num_tokens, len(step.seqs)
    for name in ("input_ids", "positions", "slot_mapping"):
        assert views[name][:tokens].tolist() == want[name]
        assert not views[name][tokens:padded].any()
    assert views["query_start"].tolist() == want["query_start"] + [tokens] * (ROWS - n)
    assert views["seq_lens"][n:].tolist() == [1] * (ROWS - n)
    assert views["state_indices"][n:].tolist() == [LAYOUT.pad_state_index] * (ROWS - n)
    assert not views["block_tables"][n:].any()
    assert np.array_equal(views["temperature"].numpy(), np.zeros(ROWS, dtype=np.float32))
    assert (views["stop_ids"].numpy() == -1).all() and not views["bias_ids"].any()


def test_one_fields_view_is_that_field_of_every_fields_views() -> None:
    layout = LAYOUT.masked(LAYOUT.step_layout(5))
    arena = torch.arange(layout.nbytes, dtype=torch.int64).to(torch.uint8)
    every = layout.views(arena)
    for name, view in every.items():
        alone = layout.view(arena, name)
        assert alone.dtype == view.dtype and alone.shape == view.shape and alone.data_ptr() == view.data_ptr()
    with pytest.raises(KeyError, match="no field 'nope'"):
        layout.view(arena, "nope")
