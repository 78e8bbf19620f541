"""The composed ops, built from a container's own ops: what runs where no provider fuses them.

Each is the plain sequence of the ops it fuses, called through ``ops`` (so a provider's
rms_norm, linear or rope_kv_write runs inside it). Over the reference ops these are the
reference of the fused ops; the decoder layer computes exactly this with or without fusion.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from corelib.ops.spec import Ops, PagedAttention, SamplingInputs

#: the id ``sample_publish`` writes for the host where a row's logits were not finite
NONFINITE = -1


def fold_norm_weight(weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] with the RMSNorm weight [K] before it folded into its columns, in its dtype (a new
    tensor): linear(rms_norm(h) * norm_weight, weight) == linear(rms_norm(h), folded), up to one rounding of
    each weight. A fused op given ``norm_weight=None`` then normalizes with a unit weight."""
    return (weight.float() * norm_weight.float()[None, :]).to(weight.dtype)


def _normed(ops: Ops, h: torch.Tensor, norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """rms_norm(h) * norm_weight; None: the weight is folded into the projection after it (a unit weight,
    rounded as the reference rounds the normalized rows)."""
    if norm_weight is None:
        return F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype)
    return ops.rms_norm(h, norm_weight, eps)[0]


def linear_residual(ops: Ops, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return residual + ops.linear(x, weight)


def norm_qkv_rope_kv_write(
    ops: Ops,
    h: torch.Tensor,
    norm_weight: torch.Tensor | None,
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
    x = _normed(ops, h, norm_weight, eps)
    qkv = ops.linear(x, qkv_weight, qkv_bias)  # [B, (nh + 2 nkv) hd]
    nh = qkv.shape[1] // hd - 2 * nkv
    qk = qkv[:, : (nh + nkv) * hd].view(-1, nh + nkv, hd)  # q and k rotated together
    v = qkv[:, (nh + nkv) * hd :].view(-1, nkv, hd)
    return ops.rope_kv_write(qk, v, positions, cos_sin, k_cache, v_cache, slot_mapping)[:, :nh]


def norm_qkv_attention(
    ops: Ops,
    h: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    attn: PagedAttention,
    scale: float,
) -> torch.Tensor:
    q = ops.norm_qkv_rope_kv_write(h, norm_weight, eps, qkv_weight, qkv_bias, positions, cos_sin, k_cache, v_cache,
                                   slot_mapping)
    return ops.paged_attention(q, k_cache, v_cache, attn, scale)


def norm_gate_up_silu_mul(
    ops: Ops, h: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, gate_up_weight: torch.Tensor
) -> torch.Tensor:
    x = _normed(ops, h, norm_weight, eps)
    return ops.silu_mul(ops.linear(x, gate_up_weight))


def norm_logits(ops: Ops, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    x, _ = ops.rms_norm(h, norm_weight, eps)
    return ops.linear(x, weight).float()


def relay_inputs(ops: Ops, input_ids: torch.Tensor, relay: torch.Tensor, states: torch.Tensor,
                 slot_tokens: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    resolved = torch.where(input_ids >= 0, input_ids, relay[states])
    slot_tokens.index_copy_(0, slot_mapping, resolved)
    return resolved


def sample_publish(ops: Ops, logits: torch.Tensor, sampling: SamplingInputs | None, checked: torch.Tensor,
                   relay: torch.Tensor, relay_slots: torch.Tensor) -> torch.Tensor:
    return publish_tokens(logits, ops.sample(logits, sampling), checked, relay, relay_slots)


def publish_tokens(logits: torch.Tensor, tokens: torch.Tensor, checked: torch.Tensor, relay: torch.Tensor,
                   relay_slots: torch.Tensor) -> torch.Tensor:
    """``sample_publish``'s writes once ``tokens`` are sampled from ``logits``; returns ``tokens``."""
    # a row holding a NaN or an inf sums to a non-finite value
    return publish_checked(tokens, torch.isfinite(logits.sum(dim=-1)), checked, relay, relay_slots)


def publish_checked(tokens: torch.Tensor, finite: torch.Tensor, checked: torch.Tensor, relay: torch.Tensor,
                    relay_slots: torch.Tensor) -> torch.Tensor:
    """``sample_publish``'s writes with the finite check's verdict given (``finite`` [B] bool: the rows whose
    logits were finite): ``tokens``, or NONFINITE where a row was not, for the host; ``tokens`` to the relay."""
    checked.copy_(torch.where(finite, tokens, NONFINITE))
    relay.index_copy_(0, relay_slots, tokens)
    return tokens
