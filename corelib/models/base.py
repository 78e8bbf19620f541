"""The model seam: what the engine knows of a model, and the batch objects it hands one.

The runner calls a :class:`Model` through these objects and nothing else; it never names an
architecture. A model owns the device state it needs (the paged KV cache, a recurrent state),
allocated once by :meth:`Model.allocate_state`, and calls the backend's ops (``corelib.ops``)
for everything a backend may accelerate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from corelib.device import Device
from corelib.ops import Ops, PagedAttention, VarlenAttention


@dataclass(frozen=True)
class ModelFacts:
    """What an architecture declares to the feature gates (``model.*`` facts), known without weights."""

    architecture: str
    paged_kv: bool = True
    device_decode_inputs: bool = True  # decode input ids may come from a device relay
    recurrent_state: bool = False  # a per-sequence state a rolled-back step would corrupt
    multimodal: bool = False

    def as_dict(self) -> dict[str, bool | str]:
        return {
            "architecture": self.architecture,
            "paged_kv": self.paged_kv,
            "device_decode_inputs": self.device_decode_inputs,
            "recurrent_state": self.recurrent_state,
            "multimodal": self.multimodal,
        }


@dataclass(frozen=True)
class DecodeBatch:
    """One new token per sequence. All tensors on the device, [B] unless noted."""

    input_ids: torch.Tensor  # int64, the relay already resolved
    positions: torch.Tensor  # int64
    slot_mapping: torch.Tensor  # int64: KV slot of the new token
    attention: PagedAttention  # block tables [B, W] and sequence lengths
    state_indices: torch.Tensor  # int64: each sequence's state index (token relay, recurrent state)


@dataclass(frozen=True)
class PrefillBatch:
    """Whole prompts, packed flat: T tokens of n sequences."""

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    attention: VarlenAttention  # cu_seqlens [n+1] and the padded grid
    last_index: torch.Tensor  # [n] int64: each sequence's last token in the flat order
    state_indices: torch.Tensor  # [n] int64


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

    def prefill(self, batch: PrefillBatch, state: ModelState, ops: Ops) -> torch.Tensor:
        """Write the prompts' KV into ``state``; return the last token's logits [n, V] float32 (or this
        rank's block of them, as ``decode`` says)."""
        ...

    def decode(self, batch: DecodeBatch, state: ModelState, ops: Ops) -> torch.Tensor:
        """Write each new token's KV into ``state``; return logits [B, V] float32. Graph-safe.

        Under tensor parallelism a model may return one rank's block of the vocabulary instead
        ([B, per_rank], from a vocabulary-parallel LM head); it then says which block in a
        ``vocab_shard`` attribute (a :class:`corelib.models.sharding.VocabShard`), and the runner
        picks the token across ranks (:mod:`corelib.step.vocab_parallel`).
        """
        ...
