"""The token bitmask of structured output, applied to the logits on the device.

A row's mask is int32 words: token ``t`` is allowed when bit ``t % 32`` of word ``t // 32`` is set
(the layout llguidance and xgrammar write). A row of all ones (-1) allows every token, so rows
without a grammar are neutral and one buffer serves every step. Graph-safe: no host sync, shapes
fixed by the buffer.
"""

from __future__ import annotations

import torch

ALL_ALLOWED = -1  # a word with every bit set


def mask_words(vocab_size: int) -> int:
    """int32 words of one row of the token bitmask."""
    return -(-vocab_size // 32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V] with every token its row's ``bitmask`` [B, ceil(V/32)] int32 disallows at -inf (a new
    tensor: the caller keeps the plain logits for its finite check and for logprobs). Tokens past the mask's
    width are disallowed."""
    rows, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).reshape(rows, -1).to(torch.bool)  # [B, 32 W]
    width = allowed.shape[1]
    if width >= vocab:
        allowed = allowed[:, :vocab]
    else:
        allowed = torch.cat([allowed, allowed.new_zeros((rows, vocab - width))], dim=1)
    return logits.masked_fill(~allowed, float("-inf"))
