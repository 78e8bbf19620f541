"""Megatron-style tensor parallelism of the Llama layout, as slices of Hugging Face tensors.

Column-parallel: q/k/v and gate/up (each rank holds a contiguous group of heads or of
intermediate features, biases alike; a fused tensor is divided part by part). Row-parallel:
o_proj and down_proj (each rank holds the matching input columns; their partial outputs are
summed with an all-reduce). The embedding is replicated (every rank looks up the same input
tokens); the LM head is vocabulary-parallel (:class:`VocabShard`): each rank holds a contiguous
block of its rows, computes that block of the logits, and a small all-reduce picks the token
(:mod:`corelib.step.vocab_parallel`). Which checkpoint tensor is which comes from the weight map
(:mod:`corelib.models.weight_map`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from corelib.errors import ConfigError
from corelib.models.shape import ModelShape
from corelib.models.weight_map import Source, Split


def check_divisible(shape: ModelShape, world: int) -> None:
    """A ConfigError naming every size that ``engine.tp`` does not divide."""
    sizes = {
        "model.num_heads": shape.num_heads,
        "model.num_kv_heads": shape.num_kv_heads,
        "model.intermediate_size": shape.intermediate_size,
    }
    bad = [f"{name}={value}" for name, value in sizes.items() if value % world]
    if bad:
        raise ConfigError(f"engine.tp={world} must divide {', '.join(bad)}")


@dataclass(frozen=True)
class TensorShard:
    """This rank's part of every weight."""

    rank: int
    world: int
    # Sums the partial outputs of the row-parallel layers across ranks (the process group's all-reduce).
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)

    def shape(self, full: ModelShape) -> ModelShape:
        """The shape of the model one rank runs: fewer heads and features, the same width."""
        check_divisible(full, self.world)
        return dataclasses.replace(
            full,
            num_heads=full.num_heads // self.world,
            num_kv_heads=full.num_kv_heads // self.world,
            intermediate_size=full.intermediate_size // self.world,
        )

    def vocab(self, vocab_size: int) -> VocabShard:
        """This rank's block of the vocabulary (its LM head rows and logits columns)."""
        return VocabShard(self.rank, self.world, vocab_size, self.all_reduce)

    def slice(self, source: Source, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the checkpoint tensor ``source`` (the whole tensor if replicated)."""
        if self.world == 1 or source.split is Split.replicated:
            return tensor
        if source.split is Split.row:
            return tensor.chunk(self.world, dim=1)[self.rank].contiguous()
        parts = torch.split(tensor, list(source.parts), dim=0) if source.parts else (tensor,)
        return torch.cat([part.chunk(self.world, dim=0)[self.rank] for part in parts], dim=0).contiguous()


@dataclass(frozen=True)
class VocabShard:
    """One rank's contiguous block of the vocabulary: ``per_rank`` rows of the LM head, the last rank's
    padded with zero rows (their logits are masked) so that every rank's block has the same size."""

    rank: int
    world: int
    vocab_size: int
    # The process group's in-place sum: what the token pick reduces through (see corelib.step.vocab_parallel).
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)

    @property
    def per_rank(self) -> int:
        return -(-self.vocab_size // self.world)

    @property
    def start(self) -> int:
        """The token id of this block's first row."""
        return self.rank * self.per_rank

    @property
    def size(self) -> int:
        """Rows of this block that are real tokens (the rest is padding)."""
        return max(0, min(self.vocab_size, self.start + self.per_rank) - self.start)

    def rows(self, lm_head: torch.Tensor) -> torch.Tensor:
        """This rank's block of the full LM head [V, H]: [per_rank, H], its own memory."""
        if lm_head.shape[0] != self.vocab_size:
            raise ValueError(f"an LM head of {lm_head.shape[0]} rows for a vocabulary of {self.vocab_size}")
        block = lm_head[self.start : self.start + self.size]
        if self.size == self.per_rank:
            return block.clone()
        padded = lm_head.new_zeros((self.per_rank, *lm_head.shape[1:]))
        padded[: self.size] = block
        return padded
