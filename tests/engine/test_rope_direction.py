"""The RoPE op turns the way Hugging Face's rotate-half RoPE does.

``q * cos + rotate_half(q) * sin`` is, per frequency i, the complex product
``(x_i + 1j * x_{i + hd/2}) * exp(1j * position * inv_freq_i)``; it is written here as that
product, sharing no code with the op. Turning the other way still gives attention scores that
depend only on relative positions, so only a comparison with the convention checkpoints were
trained with can tell. (The plain reference model is checked the same way against raw tensors
in tests/checkpoints/test_checkpoint_load.py, and the engine against that reference in
tests/engine/test_engine_reference.py.)
"""

from __future__ import annotations

import torch

from corelib.models.rope import inv_freq
from corelib.ops.reference import rope_kv_write

HEAD_DIM = 8
THETA = 10000.0


def complex_rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, n, hd] rotated by position * inv_freq as complex numbers (float64)."""
    frequencies, _ = inv_freq(HEAD_DIM, THETA, None)  # [hd/2] float64
    angles = positions.double()[:, None] * frequencies[None, :]  # [T, hd/2]
    half = HEAD_DIM // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())  # [T, n, hd/2]
    turned = z * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    return torch.cat((turned.real, turned.imag), dim=-1)


def cos_sin_table(length: int) -> torch.Tensor:
    """[length, 2, hd]: the table layout the op takes (cos, sin per position, full width)."""
    frequencies, _ = inv_freq(HEAD_DIM, THETA, None)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * frequencies[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return torch.stack((angles.cos(), angles.sin()), dim=1).float()


def test_the_rope_op_turns_like_hugging_face() -> None:
    generator = torch.Generator().manual_seed(0)
    tokens, nh, nkv, block_size, num_blocks = 5, 4, 2, 4, 4
    qk = torch.randn(tokens, nh + nkv, HEAD_DIM, generator=generator)
    v = torch.randn(tokens, nkv, HEAD_DIM, generator=generator)
    positions = torch.tensor([0, 1, 7, 30, 31])
    slot_mapping = torch.tensor([4, 5, 6, 9, 15])
    k_cache = torch.zeros(num_blocks, block_size, nkv, HEAD_DIM)
    v_cache = torch.zeros(num_blocks, block_size, nkv, HEAD_DIM)
    rotated = rope_kv_write(qk, v, positions, cos_sin_table(32), k_cache, v_cache, slot_mapping)
    expected = complex_rope(qk, positions).float()
    torch.testing.assert_close(rotated, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_cache.view(-1, nkv, HEAD_DIM)[slot_mapping], expected[:, nh:], rtol=1e-5, atol=1e-5)
    assert torch.equal(v_cache.view(-1, nkv, HEAD_DIM)[slot_mapping], v)

