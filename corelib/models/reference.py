"""The plain reference: one sequence, no batching, no cache, a full forward per new token.

Slow on purpose. Tests compare the batched, paged, graph-captured engine against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from corelib.models.llama import ModelWeights, _mlp, _qkv, rms_norm


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
