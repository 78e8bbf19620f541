"""The model seam: what the engine knows of a model, and the batch objects it hands one.

The runner calls a :class:`Model` through these objects and nothing else; it never names an
architecture. A model owns the device state it needs (the paged KV cache, a recurrent state),
allocated once by :meth:`Model.allocate_state`, and calls the backend's ops (``corelib.ops``)
for everything a backend may accelerate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from corelib.ops import Ops, PagedAttention
from corelib.platform.device import Device


@dataclass(frozen=True)
class ModelFacts:
    """What an architecture declares to the feature gates (``model.*`` facts), known without weights."""

    architecture: str
    paged_kv: bool = True
    device_decode_inputs: bool = True  # decode input ids may come from a device relay
    recurrent_state: bool = False  # a per-sequence state a rolled-back step would corrupt
    multimodal: bool = False
    # forward() over a step with prompt tokens is graph-safe once the step is padded to its token bucket
    # (StepBatch.captured): no host sync, nothing sized from the values
    ragged_graphs: bool = False

    def as_dict(self) -> dict[str, bool | str]:
        return {
            "architecture": self.architecture,
            "paged_kv": self.paged_kv,
            "device_decode_inputs": self.device_decode_inputs,
            "recurrent_state": self.recurrent_state,
            "multimodal": self.multimodal,
            "ragged_graphs": self.ragged_graphs,
        }


@dataclass(frozen=True)
class StepBatch:
    """One step: T tokens of B rows, each row's tokens the next of its sequence. All on the device.

    A decode step has one token per row (T = B, token i is row i's, graph-safe); a step of prompt
    chunks has more. Each row's keys and values are written before its attention reads the cache.
    """

    input_ids: torch.Tensor  # [T] int64, the relay already resolved
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: KV slot of each token
    attention: PagedAttention  # block tables [B, W], sequence lengths, each row's query tokens
    state_indices: torch.Tensor  # [B] int64: each row's state index (token relay, recurrent state)
    last_index: torch.Tensor | None = None  # [B] int64: each row's last token (None: token i, a decode step)
    # [B + P] int64: the tokens whose logits forward returns, each row's last then P more (prompt logprobs); None:
    # each row's last. Only an eager step carries it.
    logits_index: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        return self.last_index is None

    def last_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, ...]: each row's last token, the one whose logits it samples from."""
        return x if self.last_index is None else x[self.last_index]

    def logit_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B (+ P), ...]: the tokens whose logits forward returns (the LM head's input)."""
        return self.last_tokens(x) if self.logits_index is None else x[self.logits_index]


class ModelState:
    """The device state a model allocates once and every step reads and writes (its KV cache, a
    recurrent state). An architecture subclasses it; the engine holds it and hands it back to the
    model at every step without looking inside."""


class Model(Protocol):
    """An architecture with its weights on one device (one rank's shard under tensor parallelism)."""

    def facts(self) -> ModelFacts:
        """The facts its architecture declares."""
        ...

    def allocate_state(self, device: Device, num_blocks: int, block_size: int, num_states: int) -> ModelState:
        """The device state every step reads and writes: the KV cache of ``num_blocks`` blocks
        (block 0 is the null block padded rows write to) and any per-sequence state
        (``num_states`` state indices, plus one for padded rows)."""
        ...

    def copy_blocks(self, state: ModelState, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy KV blocks ``source`` [C] onto ``target`` [C] in every layer (copy on write of a shared
        block); a model without a paged cache has nothing to copy."""
        ...

    def forward(self, batch: StepBatch, state: ModelState, ops: Ops) -> torch.Tensor:
        """Write the step's keys and values into ``state``, then attend; return each row's last-token
        logits [B, V] float32 (those of ``batch.logit_tokens``, [B + P, V], when it asks for more).
        Graph-safe when ``batch.is_decode``.

        Under tensor parallelism a model may return one rank's block of the vocabulary instead
        ([B, per_rank], from a vocabulary-parallel LM head); it then says which block in a
        ``vocab_shard`` attribute (a :class:`corelib.models.sharding.VocabShard`), and the runner
        picks the token across ranks (:mod:`corelib.step.vocab_parallel`).
        """
        ...


@runtime_checkable
class FoldsNorms(Protocol):
    """A model that can fold its norms' weights into the projections after them, for an op provider that
    runs its fused norm ops faster so (``OpProvider.folded_norms``)."""

    def fold_norm_weights(self) -> bool:
        """Fold them (once) where its layers run the fused norm ops; returns whether they are folded."""
        ...
