"""The hybrid: a Llama-family decoder with a per-sequence causal-convolution state in every layer.

The state (the last K-1 normalised inputs of every layer, per state index) is what makes a
rolled-back step unsafe, so the architecture declares ``recurrent_state`` to the gates. A prompt
fed in chunks carries it from chunk to chunk: a chunk's first windows read the state its row left,
and a row starting at position 0 starts from zeros (a state index's previous owner left its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from corelib.models.base import ModelState, StepBatch
from corelib.models.llama import KVCache, LayerWeights, LlamaModel
from corelib.ops import Ops
from corelib.platform.device import Device


@dataclass
class HybridState(KVCache):
    """The KV cache and the convolution windows."""

    conv: torch.Tensor  # [L, num_states + 1, K-1, H]


def _conv_weights(layer: LayerWeights) -> tuple[torch.Tensor, torch.Tensor]:
    if layer.conv is None or layer.conv_norm is None:
        raise ValueError("a hybrid layer without conv weights")
    return layer.conv, layer.conv_norm


class HybridModel(LlamaModel):
    def allocate_state(self, device: Device, num_blocks: int, block_size: int, num_states: int) -> HybridState:
        cache = super().allocate_state(device, num_blocks, block_size, num_states)
        shape = self.shape
        conv = device.zeros((shape.num_layers, num_states + 1, shape.conv_kernel - 1, shape.hidden_size), shape.dtype)
        return HybridState(cache.data, cache.block_size, conv)

    @staticmethod
    def _conv_state(state: ModelState) -> torch.Tensor:
        if not isinstance(state, HybridState):
            raise TypeError(f"the hybrid runs over a HybridState, got {type(state).__name__}")
        return state.conv

    def _block(
        self, index: int, layer: LayerWeights, pending: torch.Tensor, h: torch.Tensor | None, batch: StepBatch,
        state: ModelState, ops: Ops,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The convolution reads the residual stream itself, so the pending add cannot be fused here.
        h = pending if h is None else h + pending
        conv, conv_norm = _conv_weights(layer)
        window_state = self._conv_state(state)[index]  # [S+1, K-1, H]
        xn, _ = ops.rms_norm(h, conv_norm, self.shape.rms_norm_eps)  # [T, H]
        windows = (_decode_windows if batch.is_decode else _chunk_windows)(batch, xn, window_state)
        window_state.index_copy_(0, batch.state_indices, batch.last_tokens(windows)[:, 1:])
        h = h + F.silu((windows * conv[None]).sum(dim=1))
        return super()._block(index, layer, h, None, batch, state, ops)


def _decode_windows(batch: StepBatch, xn: torch.Tensor, window_state: torch.Tensor) -> torch.Tensor:
    """[B, K, H]: each row's stored K-1 inputs, then its one new token."""
    return torch.cat([window_state[batch.state_indices], xn[:, None, :]], dim=1)


def _chunk_windows(batch: StepBatch, xn: torch.Tensor, window_state: torch.Tensor) -> torch.Tensor:
    """[T, K, H]: each token's window, reaching back into its row's stored inputs at the chunk's start.

    The stored inputs and the step's tokens are laid side by side, [B*(K-1) + T, H], and each tap of
    each token's window is gathered from there; a row that starts at position 0 reads zeros instead
    of its state index's stored inputs. Everything on the device.
    """
    attn, tokens = batch.attention, xn.shape[0]
    rows_count, taps = batch.state_indices.shape[0], window_state.shape[1] + 1
    starts = attn.query_start[:-1] if attn.query_start is not None else torch.arange(rows_count, device=xn.device)
    fresh = batch.positions[starts] == 0  # [B]: the row's chunk opens its sequence
    stored = window_state[batch.state_indices] * (~fresh).to(xn.dtype)[:, None, None]  # [B, K-1, H]
    side = torch.cat([stored.reshape(-1, xn.shape[1]), xn])
    rows = attn.token_rows(tokens)
    token = torch.arange(tokens, device=xn.device)
    offsets = torch.arange(taps, device=xn.device) - (taps - 1)  # [K]: -(K-1) .. 0
    within = (token - starts[rows])[:, None] + offsets[None, :]  # [T, K]: the tap's place in the chunk
    index = torch.where(within >= 0, rows_count * (taps - 1) + token[:, None] + offsets[None, :],
                        rows[:, None] * (taps - 1) + (taps - 1) + within)
    return side[index]
