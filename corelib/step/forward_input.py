"""ForwardInput: one step's packed inputs (an arena, layouts in :mod:`corelib.step.arena`) and its shape.

The decode layout is fixed (rows for the largest batch, columns for the longest sequence), so
captured graphs read static device views of it; prefill layouts are sized per step (prefill
runs eagerly). The scheduler side packs arenas (:mod:`corelib.engine.packing`); the device side
reads them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from corelib.ops.spec import SAMPLING_COLUMNS
from corelib.step.arena import ArenaLayout


class StepKind(str, enum.Enum):
    prefill = "prefill"
    decode = "decode"


@dataclass(frozen=True)
class ForwardInput:
    """One step's packed inputs and the shape of the work they describe."""

    step_id: int
    kind: StepKind
    num_seqs: int
    bucket: int  # decode: rows the device computes (>= num_seqs, padded); prefill: num_seqs
    kv_blocks: int  # decode: block-table columns read
    sample: bool  # some row samples (temperature > 0); else greedy
    layout: ArenaLayout
    arena: torch.Tensor  # uint8, holding layout.nbytes bytes (host memory as packed)

    def views(self) -> dict[str, torch.Tensor]:
        return self.layout.views(self.arena)


def pad_decode_rows(views: dict[str, torch.Tensor], first: int, last: int, kv_blocks: int,
                    pad_state_index: int) -> None:
    """Padded rows ``[first, last)``: token 0 at position 0 of the padding state index, null block, greedy."""
    for name in ("input_ids", "positions", "slot_mapping"):
        views[name][first:last] = 0
    views["seq_lens"][first:last] = 1
    views["state_indices"][first:last] = pad_state_index
    for column in SAMPLING_COLUMNS:
        views[column.name][first:last] = column.neutral
    views["block_tables"][first:last, :kv_blocks] = 0
