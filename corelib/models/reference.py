"""The plain reference: one sequence, no batching, no cache, a full forward per new token.

Slow on purpose. Tests compare the batched, paged, graph-captured engine against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from corelib.models.llama import LayerWeights, ModelShape, ModelWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * rope[:, 0:1] + torch.cat((-x2, x1), dim=-1) * rope[:, 1:2]


def _qkv(layer: LayerWeights, shape: ModelShape, x: torch.Tensor, positions: torch.Tensor,
         cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qkv = F.linear(x, layer.qkv, layer.qkv_bias)
    nh, nkv, hd = shape.num_heads, shape.num_kv_heads, shape.head_dim
    q = qkv[:, : nh * hd].view(-1, nh, hd)
    k = qkv[:, nh * hd : (nh + nkv) * hd].view(-1, nkv, hd)
    v = qkv[:, (nh + nkv) * hd :].view(-1, nkv, hd)
    if layer.q_norm is not None and layer.k_norm is not None:
        q, k = rms_norm(q, layer.q_norm, shape.rms_norm_eps), rms_norm(k, layer.k_norm, shape.rms_norm_eps)
    rope = cos_sin[positions]
    return _rope(q, rope), _rope(k, rope), v


def _mlp(layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, layer.down)


def reference_logits(weights: ModelWeights, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits for the next token after ``token_ids``: [V] float32."""
    shape = weights.shape
    device = weights.embed.device
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    positions = torch.arange(len(ids), device=device)
    h = weights.embed[ids]  # [T, H]
    for layer in weights.layers:
        if layer.conv is not None and layer.conv_norm is not None:
            xn = rms_norm(h, layer.conv_norm, shape.rms_norm_eps)
            kernel = layer.conv.shape[0]
            padded = F.pad(xn, (0, 0, kernel - 1, 0))  # [K-1+T, H]
            conv = sum(padded[k : k + len(ids)] * layer.conv[k] for k in range(kernel))
            h = h + F.silu(conv)  # type: ignore[arg-type]
        x = rms_norm(h, layer.input_norm, shape.rms_norm_eps)
        q, k, v = _qkv(layer, shape, x, positions, weights.cos_sin)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        )  # [nh, T, hd]
        h = h + F.linear(attn.transpose(0, 1).reshape(len(ids), -1), layer.o)
        h = h + _mlp(layer, rms_norm(h, layer.post_norm, shape.rms_norm_eps))
    last = rms_norm(h[-1:], weights.norm, shape.rms_norm_eps)
    return F.linear(last, weights.lm_head).float()[0]


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
