"""The token of a step whose logits are split by vocabulary across tensor-parallel ranks.

Each rank's LM head computes one block of the logits (:class:`corelib.models.sharding.VocabShard`).
Greedy rows need only each rank's best: its largest logit, that token's id and whether its block
was finite, three numbers per row and rank, written into a zeroed table at the rank's own place
and summed across ranks by the same all-reduce the layers use (exact: every other entry is zero).
Every rank then picks the same token: the largest value, the lowest rank among equals, so the
first maximum of the whole vocabulary, as ``argmax`` over the full logits would. A step that
samples gathers the whole logits the same way and runs the ordinary sampler on them, so a seeded
request samples what it samples at tp=1. No host sync, so the pick is captured in the graphs.
"""

from __future__ import annotations

import torch

from corelib.models.sharding import VocabShard
from corelib.ops import Ops, SamplingInputs
from corelib.ops.token_mask import apply_token_bitmask


def pick_tokens(logits: torch.Tensor, sampling: SamplingInputs | None, shard: VocabShard,
                ops: Ops, token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B] int64, finite [B] bool) from this rank's block of the logits [B, per_rank] float32.

    ``token_mask`` (a step that samples): the rows' structured-output bitmask over the whole vocabulary,
    applied to the gathered logits before the sampler (the finite check reads them unmasked)."""
    all_reduce = shard.all_reduce
    if all_reduce is None:
        raise RuntimeError("a vocabulary-parallel LM head needs the process group's all-reduce")
    if logits.dim() != 2 or logits.shape[1] != shard.per_rank:
        raise ValueError(f"logits {tuple(logits.shape)}: expected [B, {shard.per_rank}] (this rank's block)")
    rows = logits.shape[0]
    if shard.size < shard.per_rank:
        logits[:, shard.size:] = float("-inf")  # the padding rows of the last block are never picked
    if sampling is not None:
        full = gather_logits(logits, shard)
        sampled = full if token_mask is None else apply_token_bitmask(full, token_mask)
        return ops.sample(sampled, sampling), torch.isfinite(full.sum(dim=-1))
    local = ops.sample(logits, None)  # [B] this block's first maximum
    table = logits.new_zeros((3, shard.world, rows))  # best logit, its token id, block finite; per rank
    table[0, shard.rank] = logits.gather(1, local[:, None])[:, 0]
    table[1, shard.rank] = (local + shard.start).to(torch.float32)  # exact: ids are far below 2**24
    table[2, shard.rank] = torch.isfinite(logits[:, : shard.size].sum(dim=-1)).to(torch.float32)
    all_reduce(table)
    winner = table[0].argmax(dim=0, keepdim=True)  # [1, B]: the first (lowest) rank holding the largest logit
    tokens = table[1].gather(0, winner)[0].to(torch.int64)
    return tokens, table[2].sum(dim=0) == shard.world


def gather_logits(logits: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """The whole vocabulary's logits [B, V] on every rank, from each rank's block [B, per_rank] (its
    padding columns already -inf): each block written at its rank's place in a zeroed table, summed."""
    all_reduce = shard.all_reduce
    if all_reduce is None:
        raise RuntimeError("a vocabulary-parallel LM head needs the process group's all-reduce")
    rows = logits.shape[0]
    gathered = logits.new_zeros((shard.world, rows, shard.per_rank))  # [world, B, per_rank]
    gathered[shard.rank] = logits
    all_reduce(gathered)
    return gathered.permute(1, 0, 2).reshape(rows, -1)[:, : shard.vocab_size].contiguous()
