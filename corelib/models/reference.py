"""The plain reference: one sequence, no batching, no cache, a full forward per new token.

Slow on purpose. Tests compare the batched, paged, graph-captured engine against it, so it
shares no code with the engine's model or ops: every step is written out here from the
Hugging Face definitions (``LlamaRMSNorm``, ``rotate_half`` / ``apply_rotary_pos_emb``,
``repeat_kv`` + eager attention, ``LlamaMLP``; Qwen2 adds the q/k/v bias, Qwen3 the per-head
q/k RMSNorm before RoPE). Only the weights (a :class:`ModelWeights`, which holds q/k/v fused
as [q; k; v] rows and the MLP's gate/up as [gate; up] rows) and the RoPE inverse frequencies
(:func:`corelib.models.rope.inv_freq`, the checkpoint's scaling rules) come from elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from corelib.models.llama import LayerWeights, ModelWeights
from corelib.models.rope import inv_freq
from corelib.models.shape import ModelShape


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # LlamaRMSNorm: statistics in float32, back to the input dtype, then the weight in that dtype
    # (None: folded into the projection after it, LayerWeights.norms_folded)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(x.dtype) if weight is None else weight * h.to(x.dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)  # nn.Linear: x @ W^T + b


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def _cos_sin(shape: ModelShape, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, hd] for positions 0..T-1, in the model dtype (LlamaRotaryEmbedding)."""
    frequencies, scale = inv_freq(shape.head_dim, shape.rope_theta, shape.rope_scaling)  # [hd/2] float64
    angles = torch.arange(length, dtype=torch.float64)[:, None] * frequencies[None, :]  # [T, hd/2]
    angles = torch.cat((angles, angles), dim=-1).to(torch.float32)  # [T, hd]
    cos, sin = angles.cos() * scale, angles.sin() * scale
    return cos.to(device=device, dtype=shape.dtype), sin.to(device=device, dtype=shape.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [n, T, hd]; cos/sin [T, hd]
    return x * cos + _rotate_half(x) * sin


def _attention(layer: LayerWeights, shape: ModelShape, x: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
    """Causal self-attention of one sequence, x [T, H] -> [T, H]."""
    length = x.shape[0]
    nh, nkv, hd = shape.num_heads, shape.num_kv_heads, shape.head_dim
    q_rows, k_rows = nh * hd, nkv * hd
    q_w, k_w, v_w = layer.qkv[:q_rows], layer.qkv[q_rows : q_rows + k_rows], layer.qkv[q_rows + k_rows :]
    q_b = k_b = v_b = None
    if layer.qkv_bias is not None:
        bias = layer.qkv_bias
        q_b, k_b, v_b = bias[:q_rows], bias[q_rows : q_rows + k_rows], bias[q_rows + k_rows :]
    q = _linear(x, q_w, q_b).view(length, nh, hd).transpose(0, 1)  # [nh, T, hd]
    k = _linear(x, k_w, k_b).view(length, nkv, hd).transpose(0, 1)  # [nkv, T, hd]
    v = _linear(x, v_w, v_b).view(length, nkv, hd).transpose(0, 1)  # [nkv, T, hd]
    if layer.q_norm is not None and layer.k_norm is not None:  # Qwen3: per head, before RoPE
        q = _rms_norm(q, layer.q_norm, shape.rms_norm_eps)
        k = _rms_norm(k, layer.k_norm, shape.rms_norm_eps)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    group = nh // nkv  # repeat_kv: query head j reads KV head j // group
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # [nh, T, hd]
    scores = (q @ k.transpose(1, 2)) * hd**-0.5  # [nh, T, T]
    future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = (probs @ v).transpose(0, 1).reshape(length, nh * hd)  # [T, nh hd]
    return _linear(out, layer.o)


def _mlp(layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    # LlamaMLP: down(silu(gate(x)) * up(x))
    inner = layer.down.shape[1]
    gate_w, up_w = layer.gate_up[:inner], layer.gate_up[inner:]
    return _linear(_silu(_linear(x, gate_w)) * _linear(x, up_w), layer.down)


def _conv(layer: LayerWeights, shape: ModelShape, h: torch.Tensor) -> torch.Tensor:
    """The hybrid branch: a depthwise causal convolution over the normalised inputs, then SiLU."""
    assert layer.conv is not None and layer.conv_norm is not None, "hybrid layer without conv weights"
    xn = _rms_norm(h, layer.conv_norm, shape.rms_norm_eps)  # [T, H]
    kernel, length = layer.conv.shape[0], h.shape[0]
    padded = torch.cat((xn.new_zeros(kernel - 1, xn.shape[1]), xn))  # [K-1+T, H]
    out = torch.zeros_like(xn)
    for tap in range(kernel):  # output t reads inputs t-K+1 .. t
        out = out + padded[tap : tap + length] * layer.conv[tap]
    return _silu(out)


def reference_logits(weights: ModelWeights, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits for the next token after ``token_ids``: [V] float32."""
    last = _rms_norm(_hidden(weights, token_ids)[-1:], weights.norm, weights.shape.rms_norm_eps)
    return _linear(last, weights.lm_head).float()[0]


def reference_prompt_logits(weights: ModelWeights, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits at every position of ``token_ids`` (row i: the next token after the first i + 1): [T, V] float32."""
    h = _rms_norm(_hidden(weights, token_ids), weights.norm, weights.shape.rms_norm_eps)
    return _linear(h, weights.lm_head).float()


def _hidden(weights: ModelWeights, token_ids: Sequence[int]) -> torch.Tensor:
    """The last layer's output at every position of ``token_ids``: [T, H]."""
    shape = weights.shape
    device = weights.embed.device
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    cos, sin = _cos_sin(shape, len(ids), device)
    h = weights.embed[ids]  # [T, H]
    for layer in weights.layers:
        if layer.conv is not None:
            h = h + _conv(layer, shape, h)
        h = h + _attention(layer, shape, _rms_norm(h, layer.norm_before_qkv, shape.rms_norm_eps), cos, sin)
        h = h + _mlp(layer, _rms_norm(h, layer.norm_before_gate_up, shape.rms_norm_eps))
    return h


def reference_generate(
    weights: ModelWeights,
    prompt: Sequence[int],
    max_tokens: int,
    eos_token_id: int | None = None,
    stop_token_ids: Sequence[int] = (),
) -> list[int]:
    """Greedy decoding, recomputing everything at every step."""
    tokens = list(prompt)
    out: list[int] = []
    stops = set(stop_token_ids) | ({eos_token_id} if eos_token_id is not None else set())
    with torch.inference_mode():
        for _ in range(max_tokens):
            token = int(reference_logits(weights, tokens).argmax())
            out.append(token)
            tokens.append(token)
            if token in stops:
                break
    return out
