"""The composed ops, built from a container's own ops: what runs where no provider fuses them.

Each is the plain sequence of the ops it fuses, called through ``ops`` (so a provider's
rms_norm, linear or rope_kv_write runs inside it). Over the reference ops these are the
reference of the fused ops; the decoder layer computes exactly this with or without fusion.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from corelib.ops.spec import Ops


def linear_residual(ops: Ops, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return residual + ops.linear(x, weight)


def norm_qkv_rope_kv_write(
    ops: Ops,
    h: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    nkv, hd = k_cache.shape[2], k_cache.shape[3]
    x, _ = ops.rms_norm(h, norm_weight, eps)
    qkv = ops.linear(x, qkv_weight, qkv_bias)  # [B, (nh + 2 nkv) hd]
    nh = qkv.shape[1] // hd - 2 * nkv
    qk = qkv[:, : (nh + nkv) * hd].view(-1, nh + nkv, hd)  # q and k rotated together
    v = qkv[:, (nh + nkv) * hd :].view(-1, nkv, hd)
    return ops.rope_kv_write(qk, v, positions, cos_sin, k_cache, v_cache, slot_mapping)[:, :nh]


def norm_gate_up_silu_mul(
    ops: Ops, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor
) -> torch.Tensor:
    x, _ = ops.rms_norm(h, norm_weight, eps)
    return ops.silu_mul(ops.linear(x, gate_up_weight))


def norm_logits(ops: Ops, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    x, _ = ops.rms_norm(h, norm_weight, eps)
    return ops.linear(x, weight).float()
