"""The hybrid: a Llama-family decoder with a per-sequence causal-convolution state in every layer.

The state (the last K-1 normalised inputs of every layer, per state index) is what makes a
rolled-back step unsafe, so the architecture declares ``recurrent_state`` to the gates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from corelib.device import Device
from corelib.models.base import DecodeBatch, ModelState, PrefillBatch
from corelib.models.llama import KVCache, LayerWeights, LlamaModel
from corelib.ops import Ops


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

    def _decode_block(
        self, index: int, layer: LayerWeights, pending: torch.Tensor, h: torch.Tensor | None, batch: DecodeBatch,
        state: ModelState, ops: Ops,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The convolution reads the residual stream itself, so the pending add cannot be fused here.
        h = pending if h is None else h + pending
        conv, conv_norm = _conv_weights(layer)
        states, window_state = batch.state_indices, self._conv_state(state)[index]
        xn, _ = ops.rms_norm(h, conv_norm, self.shape.rms_norm_eps)  # [B, H]
        window = torch.cat([window_state[states], xn[:, None, :]], dim=1)  # [B, K, H]
        window_state.index_copy_(0, states, window[:, 1:])
        h = h + F.silu((window * conv[None]).sum(dim=1))
        return super()._decode_block(index, layer, h, None, batch, state, ops)

    def _before_layer(
        self, index: int, layer: LayerWeights, pending: torch.Tensor, h: torch.Tensor | None, batch: PrefillBatch,
        state: ModelState, ops: Ops,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = pending if h is None else h + pending
        conv, conv_norm = _conv_weights(layer)
        kernel = conv.shape[0]
        pad_index, valid = batch.attention.padded()
        xn, _ = ops.rms_norm(h, conv_norm, self.shape.rms_norm_eps)  # [T, H]
        padded = F.pad(xn[pad_index] * valid[..., None], (0, 0, kernel - 1, 0))  # [n, K-1+L, H]
        windows = padded.unfold(1, kernel, 1)  # [n, L, H, K]
        out = torch.einsum("nlhk,kh->nlh", windows, conv)
        lengths = batch.attention.cu_seqlens[1:] - batch.attention.cu_seqlens[:-1]  # [n]
        tail_pos = lengths[:, None] + torch.arange(kernel - 1, device=h.device)[None, :]  # in padded coords
        tail = padded.gather(1, tail_pos[..., None].expand(-1, -1, padded.shape[-1]))
        self._conv_state(state)[index].index_copy_(0, batch.state_indices, tail)
        return h + F.silu(out[valid]), None
