"""The step layout: one step's inputs as the named fields of one arena, and the width of a row's logprobs.

The packer (:mod:`corelib.engine.packing`) writes a step in this layout, an SHM frame
(:mod:`corelib.transport.wire`) carries it unchanged, and the runner (:mod:`corelib.step.runner`)
reads it; the arena mechanics are :mod:`corelib.step.arena`. A frame names the fields it carries,
so both ends of the SHM transport agree on them by name.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from corelib.ops.spec import SAMPLING_COLUMNS, SAMPLING_TABLES
from corelib.sampling_params import MAX_LOGPROBS
from corelib.step.arena import ArenaLayout, Field

# One step: R rows (one per sequence, R = the engine's largest batch), W block-table columns and
# T tokens, the rows' queries one after another. The row fields come first, so their offsets are
# the same whatever T is: a decode step (T = R, one token per row) is the fixed layout a captured
# graph reads, and a step of prefill chunks the same layout with more tokens.
ROW_FIELDS: tuple[tuple[str, torch.dtype], ...] = (
    ("seq_lens", torch.int64),  # keys each row attends to once this step's are written
    ("state_indices", torch.int64),  # per-sequence slot: token relay, recurrent state
    ("sample_slots", torch.int64),  # the relay slot of the row's sample: its state index, or the padding one
    ("prompt_lens", torch.int64),  # tokens of the row's prompt: the penalties count later positions as outputs
    ("copy_from", torch.int64),  # copy on write: the first num_copies entries name KV blocks to copy ...
    ("copy_to", torch.int64),  # ... into these, before the forward
    ("recount_rows", torch.int64),  # the first num_recounts entries: rows whose penalty counts are rebuilt first
    *((column.name, column.dtype) for column in SAMPLING_COLUMNS),
)
TOKEN_FIELDS: tuple[tuple[str, torch.dtype], ...] = (
    ("input_ids", torch.int64),  # RELAY: the token sampled by the previous step, on the device
    ("positions", torch.int64),
    ("slot_mapping", torch.int64),  # KV cache slot of the token: block * block_size + offset
)
TOKEN_NAMES = tuple(name for name, _ in TOKEN_FIELDS)
#: the per-row sampling tables [R, width] (logit_bias, min_tokens' stop ids), after the row fields
TABLE_NAMES = tuple(table.name for table in SAMPLING_TABLES)
STEP_FIELD_NAMES = (*(name for name, _ in ROW_FIELDS), *TABLE_NAMES, "query_start", "block_tables", *TOKEN_NAMES)


@functools.lru_cache(maxsize=64)
def step_layout(tokens: int, rows: int, width: int) -> ArenaLayout:
    """The arena of a step of ``tokens`` token slots over ``rows`` rows of ``width`` blocks each.

    query_start [R+1]: row i's tokens are query_start[i]:query_start[i+1] (a decode step leaves it
    unread: token i is row i's).
    """
    return ArenaLayout.of([
        *(Field(name, dtype, (rows,)) for name, dtype in ROW_FIELDS),
        *(Field(table.name, table.dtype, (rows, table.width)) for table in SAMPLING_TABLES),
        Field("query_start", torch.int64, (rows + 1,)),
        Field("block_tables", torch.int32, (rows, width)),
        *(Field(name, dtype, (tokens,)) for name, dtype in TOKEN_FIELDS),
    ])


PROMPT_LOGPROBS = "prompt_logprobs"  # prompt logprobs: the positions whose logits a step also computes, and next tokens


@functools.lru_cache(maxsize=64)
def with_prompt_logprobs(layout: ArenaLayout, count: int) -> ArenaLayout:
    """``layout`` with the ``count`` prompt positions whose logprobs the step computes: int64 [2, count], row 0
    each one's index among the step's tokens (its logits), row 1 the prompt token that follows it (whose logprob
    and rank it gives). Only a step holding such positions carries it (before any token bitmask), and it flags
    the frame (``InputFlags.PROMPT_LOGPROBS``), so the others copy and send no more than before."""
    return ArenaLayout.of([*layout.fields, Field(PROMPT_LOGPROBS, torch.int64, (2, count))])


TOKEN_MASK = "token_mask"  # structured output: the rows' token bitmask, a last field only steps holding such rows carry


@functools.lru_cache(maxsize=64)
def with_token_mask(layout: ArenaLayout, rows: int, words: int) -> ArenaLayout:
    """``layout`` with the token bitmask of its ``rows`` rows after every other field: int32 [rows, words], bit
    ``t % 32`` of word ``t // 32`` set where token ``t`` may be sampled (all ones: no grammar). Only a step
    holding a structured-output row carries it, so the others copy and send no more than before."""
    return ArenaLayout.of([*layout.fields, Field(TOKEN_MASK, torch.int32, (rows, words))])


def pad_rows(views: Mapping[str, Any], first: int, last: int, kv_blocks: int, pad_state_index: int) -> None:
    """Rows (and their tokens) ``[first, last)`` of a decode step: token 0 at position 0 of the padding
    state index, on the null block, greedy, sampling into the padding slot. ``views``: the step layout's
    views as torch tensors or numpy arrays (the packer writes through numpy)."""
    for name in TOKEN_NAMES:
        views[name][first:last] = 0
    pad_row_fields(views, first, last, kv_blocks, pad_state_index)


def pad_row_fields(
    views: Mapping[str, Any], first: int, last: int, kv_blocks: int, pad_state_index: int, sampling: bool = True
) -> None:
    """The row fields of rows ``[first, last)``, as :func:`pad_rows` writes them, and none of the tokens; without
    ``sampling``, none of the sampling columns and tables either (the caller writes those)."""
    views["seq_lens"][first:last] = 1
    views["state_indices"][first:last] = pad_state_index
    views["sample_slots"][first:last] = pad_state_index
    views["prompt_lens"][first:last] = 1
    views["copy_from"][first:last] = 0
    views["copy_to"][first:last] = 0
    views["recount_rows"][first:last] = 0
    if sampling:
        for column in SAMPLING_COLUMNS:
            views[column.name][first:last] = column.neutral
        for table in SAMPLING_TABLES:
            views[table.name][first:last] = table.neutral
    views["block_tables"][first:last, :kv_blocks] = 0


#: a row's logprobs as floats: the sampled token's, its rank, the top ones' values, then their token ids (the
#: integers exact in float32)
LOGPROB_WIDTH = 2 + 2 * MAX_LOGPROBS  # the token's logprob, its rank, the top values, their token ids
