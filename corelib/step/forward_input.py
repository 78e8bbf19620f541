"""ForwardInput: one step's packed inputs (an arena in the step layout of :mod:`corelib.step.fields`) and its shape.

A step is flat tokens (each row's queries, one after another) and one row per sequence. Its
shape is host ints: rows computed, tokens computed, the longest row's query count, KV columns.
A step whose rows all have one query is a decode step: it uses the fixed layout whose views a
captured graph reads. The scheduler side packs arenas (:mod:`corelib.engine.packing`); the
device side reads them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from corelib.step.arena import ArenaLayout


class StepKind(str, enum.Enum):
    prefill = "prefill"  # some row feeds several tokens (a prompt, or a chunk of one)
    decode = "decode"  # every row feeds one token: the graph-captured shape


@dataclass(slots=True)
class ForwardInput:
    """One step's packed inputs and the shape of the work they describe. Not frozen: a frozen dataclass's
    ``__init__`` costs five times as much, on the path of every step (twice over SHM); nothing changes one."""

    step_id: int
    num_seqs: int  # rows that hold a sequence
    bucket: int  # rows the device computes (>= num_seqs: a decode step pads to its graph's rows)
    num_tokens: int  # tokens the device computes (a decode step: bucket, one per row)
    max_query_len: int  # the most tokens one row feeds (1: a decode step)
    kv_blocks: int  # block-table columns read
    sample: bool  # some row needs the sampler (logit_bias, min_tokens, a penalty, a grammar, temperature); else argmax
    layout: ArenaLayout
    arena: torch.Tensor  # uint8, holding layout.nbytes bytes (host memory as packed)
    logprobs: bool = False  # some row asks for its tokens' logprobs: the step computes them on the device
    num_copies: int = 0  # KV blocks copied (copy on write) before the forward
    decode_rows: int = 0  # a step with chunks: its first rows feed one token each (listed first)
    # A step with prompt tokens padded to its token bucket: num_tokens is the bucket and bucket the layout's rows;
    # the rows past num_seqs are empty and the tokens past the step's belong to none (a graph per bucket runs it).
    padded: bool = False
    # Prompt positions whose logprobs the step computes (the layout's PROMPT_LOGPROBS field): such a step runs eagerly.
    prompt_logprobs: int = 0
    # Rows (the first entries of recount_rows) of sequences with a penalty that are new to their state index: their
    # penalty counts are rebuilt from the tokens their blocks hold, before the forward (outside any graph).
    num_recounts: int = 0
    # Structured output run ahead: the step's token bitmask (its layout's last field) is written after it is queued,
    # once the host has read the previous step's tokens; the device queues the forward now and the sampling when
    # the mask is supplied (DeviceSteps.supply_mask).
    mask_deferred: bool = False
    # A step that needs the sampler: some row draws (temperature > 0). False: every row takes the argmax of its
    # processed logits (the sampler's variant without the draw's noise over the vocabulary).
    draws: bool = True
    # With draws: some row has a cut (top-k, top-p below 1, min_p), so the sampler sorts the vocabulary first.
    # False: no row cuts; the draw is noise and an argmax. True is never wrong, only slower.
    cuts: bool = True

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1

    @property
    def kind(self) -> StepKind:
        return StepKind.decode if self.is_decode else StepKind.prefill

    def views(self) -> dict[str, torch.Tensor]:
        return self.layout.views(self.arena)
