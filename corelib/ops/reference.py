"""The plain-torch reference of every op: the fallback for every backend, and the conformance oracle.

These follow Hugging Face's Llama numerics (RMSNorm statistics in float32, the weight applied
in the model dtype; rotate-half RoPE with a cos/sin table in the model dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from corelib.ops.sampling import sample_rows
from corelib.ops.spec import Ops, PagedAttention, SamplingInputs


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


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: PagedAttention, scale: float
) -> torch.Tensor:
    """paged_attention of a decode step: one query per row over its live cached keys, [B, nh, hd]."""
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


#: the keys (and as many values) a captured step's attention gathers at once, at most: bounds its memory
CAPTURED_GATHER_ELEMENTS = 1 << 24


def captured_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: PagedAttention, scale: float
) -> torch.Tensor:
    """paged_attention of a captured step (``attn.captured``): each token over its own row's keys, in chunks
    of tokens sized from the shapes alone, so every step of the token bucket runs the same work; [T, nh, hd].

    A token past ``query_start[B]`` belongs to no row: it is counted in the last row (so it sees a
    key, and nothing is empty) and its output is set to 0.
    """
    if attn.query_start is None:
        raise ValueError("a captured step of prompt tokens needs query_start [B+1]")
    tokens, batch = q.shape[0], attn.block_tables.shape[0]
    nkv, hd = k_cache.shape[2], k_cache.shape[3]
    span = attn.block_tables.shape[1] * k_cache.shape[1]
    index = torch.arange(tokens, device=q.device)
    rows = attn.token_rows(tokens)  # [T]
    positions = attn.seq_lens[rows] - attn.query_start[rows + 1] + index  # each token's place in its sequence
    owned = index < attn.query_start[batch]
    key_pos = torch.arange(span, device=q.device)
    chunk = max(1, CAPTURED_GATHER_ELEMENTS // (span * nkv * hd))
    parts = []
    for first in range(0, tokens, chunk):
        r = rows[first : first + chunk]
        count = r.shape[0]
        keys = k_cache[attn.block_tables[r]].view(count, span, nkv, hd).transpose(1, 2)  # [C, nkv, S, hd]
        values = v_cache[attn.block_tables[r]].view(count, span, nkv, hd).transpose(1, 2)
        visible = (key_pos[None, :] <= positions[first : first + chunk, None]) & (key_pos < attn.seq_lens[r, None])
        out = F.scaled_dot_product_attention(q[first : first + chunk, :, None, :], keys, values,
                                             attn_mask=visible[:, None, None, :], scale=scale, enable_gqa=True)
        parts.append(out[:, :, 0, :])  # [C, nh, hd]
    out = torch.cat(parts)
    return torch.where(owned[:, None, None], out, out.new_zeros(()))


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: PagedAttention, scale: float
) -> torch.Tensor:
    if attn.captured:
        return captured_attention(q, k_cache, v_cache, attn, scale)
    if attn.is_decode:
        return decode_attention(q, k_cache, v_cache, attn, scale)
    if attn.decode_rows:  # the decode rows as a decode step: no row padded to the longest chunk
        decode, chunks = attn.split()
        d = attn.decode_rows
        return torch.cat([decode_attention(q[:d], k_cache, v_cache, decode, scale),
                          paged_attention(q[d:], k_cache, v_cache, chunks, scale)])
    batch, width = attn.block_tables.shape
    nkv, hd = k_cache.shape[2], k_cache.shape[3]
    span = width * k_cache.shape[1]
    keys = k_cache[attn.block_tables].view(batch, span, nkv, hd).transpose(1, 2)  # [B, nkv, S, hd]
    values = v_cache[attn.block_tables].view(batch, span, nkv, hd).transpose(1, 2)
    grid = QueryGrid.of(attn, q.shape[0], span)
    out = F.scaled_dot_product_attention(
        q[grid.index].transpose(1, 2), keys, values, attn_mask=grid.visible[:, None], scale=scale, enable_gqa=True
    )  # [B, nh, L, hd]
    return grid.unpad(out.transpose(1, 2))  # [T, nh, hd]


@dataclass(frozen=True)
class QueryGrid:
    """A step's queries as a padded grid [B, L] (L = the longest row's queries), and back to [T].

    index [B, L]: the step token each cell holds (row i's query j is token query_start[i] + j);
    visible [B, L, S]: the keys of the row's first S cache positions each cell attends to (up to
    its own position, and within the row's length; a padding cell sees the row's keys, so no
    cell is empty); rows / columns [T]: each token's cell. Everything is found on the device.
    """

    index: torch.Tensor
    visible: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor

    @classmethod
    def of(cls, attn: PagedAttention, tokens: int, span: int) -> QueryGrid:
        batch, device = attn.block_tables.shape[0], attn.seq_lens.device
        starts = attn.query_start[:-1] if attn.query_start is not None else torch.arange(batch, device=device)
        lengths, longest = attn.query_lens(), attn.max_query_len
        columns = torch.arange(longest, device=device)
        index = (starts[:, None] + columns[None, :]).clamp(max=max(tokens - 1, 0))
        query_pos = (attn.seq_lens - lengths)[:, None] + columns[None, :]  # [B, L]
        key_pos = torch.arange(span, device=device)
        visible = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos < attn.seq_lens[:, None])[:, None, :]
        rows = attn.token_rows(tokens)
        token_columns = (torch.arange(tokens, device=device) - starts[rows]).clamp(0, longest - 1)
        return cls(index, visible, rows, token_columns)

    def unpad(self, grid: torch.Tensor) -> torch.Tensor:
        """[B, L, ...] -> [T, ...]: each token's cell."""
        return grid[self.rows, self.columns]


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
        paged_attention=paged_attention,
        silu_mul=silu_mul,
        sample=sample,
        linear=linear,
    )
