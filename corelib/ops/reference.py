"""The plain-torch reference of every op: the fallback for every backend, and the conformance oracle.

These follow Hugging Face's Llama numerics (RMSNorm statistics in float32, the weight applied
in the model dtype; rotate-half RoPE with a cos/sin table in the model dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from corelib.ops.sampling import sample_rows
from corelib.ops.spec import Ops, PagedAttention, SamplingInputs, VarlenAttention


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    h = x if residual is None else x + residual
    return weight * F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype), h


def _rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    # x [T, n, hd], rope [T, 2, hd]: x * cos + rotate_half(x) * sin
    x1, x2 = x.chunk(2, dim=-1)
    return x * rope[:, 0:1] + torch.cat((-x2, x1), dim=-1) * rope[:, 1:2]


def rope_kv_write(
    qk: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    nkv, hd = v.shape[1], v.shape[2]
    rotated = _rotate(qk, cos_sin[positions])  # q and k in one pass
    k_cache.view(-1, nkv, hd).index_copy_(0, slot_mapping, rotated[:, -nkv:])
    v_cache.view(-1, nkv, hd).index_copy_(0, slot_mapping, v)
    return rotated


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: PagedAttention, scale: float
) -> torch.Tensor:
    batch, width = attn.block_tables.shape
    nkv, hd = k_cache.shape[2], k_cache.shape[3]
    span = width * k_cache.shape[1]
    # [B, W, bs, nkv, hd] -> [B, nkv, S, hd]: only the first W blocks of each table
    keys = k_cache[attn.block_tables].view(batch, span, nkv, hd).transpose(1, 2)
    values = v_cache[attn.block_tables].view(batch, span, nkv, hd).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys, values, attn_mask=attn.key_mask, scale=scale, enable_gqa=True
    )
    return out[:, :, 0, :]


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: VarlenAttention, scale: float
) -> torch.Tensor:
    pad_index, valid = attn.padded()
    length = pad_index.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    mask = (causal[None] & valid[:, None, :])[:, None]  # [n, 1, L, L]
    qp, kp, vp = (t[pad_index].transpose(1, 2) for t in (q, k, v))  # [n, heads, L, hd]
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)[valid]  # [T, nh, hd]


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def sample(logits: torch.Tensor, sampling: SamplingInputs | None) -> torch.Tensor:
    if sampling is None:
        return logits.argmax(dim=-1)
    return sample_rows(logits, sampling)


def reference_ops() -> Ops:
    """Every op on its plain-torch reference: the fallback on every backend."""
    return Ops(
        rms_norm=rms_norm,
        rope_kv_write=rope_kv_write,
        paged_decode_attention=paged_decode_attention,
        prefill_attention=prefill_attention,
        silu_mul=silu_mul,
        sample=sample,
        linear=linear,
    )
