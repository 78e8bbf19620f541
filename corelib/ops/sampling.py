"""Sampling on the device: greedy, temperature, top-k and top-p, seeded per request.

No host sync: randomness is a counter-based hash of (request seed, position, token id),
so a request samples the same tokens whatever batch it shares, on any device, and the
whole sampler can be captured in a graph.
"""

from __future__ import annotations

import torch

from corelib.ops.spec import SamplingInputs


def _int64(constant: int) -> int:
    """A 64-bit constant as the signed value torch's int64 arithmetic wraps around."""
    return constant - (1 << 64) if constant >= 1 << 63 else constant


_GOLDEN = _int64(0x9E3779B97F4A7C15)
_MIX1 = _int64(0xBF58476D1CE4E5B9)
_MIX2 = _int64(0x94D049BB133111EB)
_POSITION_KEY = _int64(0x632BE59BD9B4E019)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    # splitmix64 finaliser on int64 (wrapping arithmetic; shifts are arithmetic, still a bijection mix)
    x = x + _GOLDEN
    x = (x ^ (x >> 30)) * _MIX1
    x = (x ^ (x >> 27)) * _MIX2
    return x ^ (x >> 31)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, K] for the given token ids [B, K]; seeds and positions are [B]."""
    key = _mix64(seeds * _POSITION_KEY + positions)  # [B]
    bits = _mix64(key[:, None] ^ token_ids)  # [B, K]
    # The mix's last step, x ^ (x >> 31), shifts arithmetically: bit 63 always ends 0. Bits 39-62 are uniform.
    uniform = (((bits >> 39) & 0xFFFFFF).to(torch.float32) + 0.5) / 16777216.0
    return -torch.log(-torch.log(uniform))


def sample_rows(logits: torch.Tensor, sampling: SamplingInputs) -> torch.Tensor:
    """Per-row sampling; rows with temperature 0 are greedy. logits [B, V] float32 -> [B] int64."""
    temperature, top_k, top_p = sampling.temperature, sampling.top_k, sampling.top_p
    seeds, positions = sampling.seeds, sampling.positions
    vocab = logits.shape[-1]
    scaled = logits / temperature.clamp_min(1e-5)[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    keep = ranks < torch.where(top_k > 0, top_k, vocab)[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass ranked above each token
    keep = keep & (before < top_p[:, None])
    noisy = sorted_logits + gumbel_noise(seeds, positions, order)
    choice = noisy.masked_fill(~keep, float("-inf")).argmax(dim=-1, keepdim=True)
    sampled = order.gather(-1, choice)[:, 0]
    return torch.where(temperature > 0, sampled, logits.argmax(dim=-1))
