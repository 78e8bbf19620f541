"""Inputs of the projection ops' conformance cases (``linear``, ``linear_residual`` and the fused norm ops), as
:mod:`corelib.testing.op_cases` builds the others: the same tensors from a seed on any device; and the cases.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from corelib.ops import PagedAttention, fold_norm_weight
from corelib.testing.op_cases import BF16, F32, LONG_CONTEXT, Args, DecodeCase, cos_sin_table, randn, rope_kv_inputs


def weight(gen: torch.Generator, rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """A projection weight scaled as the random initialisation scales it (outputs of unit size)."""
    return randn(gen, rows, k, dtype=F32).mul(k**-0.5).to(dtype)


@dataclass(frozen=True)
class LinearCase:
    dtype: torch.dtype
    m: int  # rows of x: a decode batch (1-128) or a prefill
    n: int
    k: int
    bias: bool = False

    def build(self, seed: int, device: torch.device) -> Args:
        gen = torch.Generator().manual_seed(seed)
        x = randn(gen, self.m, self.k, dtype=self.dtype)
        w = weight(gen, self.n, self.k, self.dtype)
        b = randn(gen, self.n, dtype=self.dtype) if self.bias else None
        return x.to(device), w.to(device), None if b is None else b.to(device)


@dataclass(frozen=True)
class LinearResidualCase:
    dtype: torch.dtype
    m: int
    n: int
    k: int

    def build(self, seed: int, device: torch.device) -> Args:
        gen = torch.Generator().manual_seed(seed)
        x, w = randn(gen, self.m, self.k, dtype=self.dtype), weight(gen, self.n, self.k, self.dtype)
        return x.to(device), w.to(device), randn(gen, self.m, self.n, dtype=self.dtype).to(device)


def norm_weight(gen: torch.Generator, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    return (1.0 + 0.1 * randn(gen, hidden)).to(dtype)


def normed_product(gen: torch.Generator, m: int, hidden: int, rows: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused norm op's h [m, hidden], the norm's weight [hidden] and the projection's weight [rows, hidden]."""
    h = randn(gen, m, hidden, dtype=dtype)
    return h, norm_weight(gen, hidden, dtype), weight(gen, rows, hidden, dtype)


@dataclass(frozen=True)
class NormGateUpCase:
    dtype: torch.dtype
    m: int
    hidden: int
    inter: int
    folded: bool = False  # the norm's weight folded into gate_up's columns, norm_weight None

    def build(self, seed: int, device: torch.device) -> Args:
        gen = torch.Generator().manual_seed(seed)
        h, nw, gate_up = normed_product(gen, self.m, self.hidden, 2 * self.inter, self.dtype)
        if self.folded:
            return h.to(device), None, 1e-6, fold_norm_weight(gate_up, nw).to(device)
        return h.to(device), nw.to(device), 1e-6, gate_up.to(device)


@dataclass(frozen=True)
class NormLogitsCase:
    dtype: torch.dtype
    m: int
    hidden: int
    vocab: int

    @property
    def tolerance_dtype(self) -> torch.dtype:
        """The logits are float32, but their error is the model dtype's (the reference rounds to it)."""
        return self.dtype

    def build(self, seed: int, device: torch.device) -> Args:
        h, nw, head = normed_product(torch.Generator().manual_seed(seed), self.m, self.hidden, self.vocab, self.dtype)
        return h.to(device), nw.to(device), 1e-6, head.to(device)


@dataclass(frozen=True)
class NormQkvCase:
    dtype: torch.dtype
    batch: int
    group: int
    head_dim: int
    block_size: int
    hidden: int = 256
    kv_heads: int = 2
    bias: bool = False  # Qwen2's qkv bias
    folded: bool = False  # the norm's weight folded into qkv's columns, norm_weight None

    def build(self, seed: int, device: torch.device) -> Args:
        gen = torch.Generator().manual_seed(seed)
        nkv, hd = self.kv_heads, self.head_dim
        rows = (nkv * self.group + 2 * nkv) * hd
        h, nw, qkv = normed_product(gen, self.batch, self.hidden, rows, self.dtype)
        bias = randn(gen, rows, dtype=self.dtype) if self.bias else None
        positions, cos_sin, kc, vc, slots = rope_kv_inputs(gen, self.batch, self.block_size, nkv, hd, self.dtype,
                                                           device)
        if self.folded:
            qkv = fold_norm_weight(qkv, nw)
        return (h.to(device), None if self.folded else nw.to(device), 1e-6, qkv.to(device),
                None if bias is None else bias.to(device), positions, cos_sin, kc, vc, slots)


@dataclass(frozen=True)
class NormQkvAttentionCase:
    """A decode step's attention from the residual stream: the qkv case's projection over the attention case's
    paged cache (ragged contexts, a padded row on block 0), each row's query at its newest position
    and its new key and value written to that position's slot."""

    dtype: torch.dtype
    batch: int
    group: int
    head_dim: int
    block_size: int
    hidden: int = 256
    kv_heads: int = 2
    bias: bool = False
    folded: bool = False
    long: int = LONG_CONTEXT

    @property
    def qkv_rows(self) -> int:
        """The qkv weight's rows: (nh + 2 nkv) hd."""
        return (self.kv_heads * self.group + 2 * self.kv_heads) * self.head_dim

    def build(self, seed: int, device: torch.device) -> Args:
        nkv, hd, bs = self.kv_heads, self.head_dim, self.block_size
        _, kc, vc, attn, scale, _ = DecodeCase(self.dtype, self.batch, self.group, hd, bs, self.long, nkv).build(
            seed, device)
        assert isinstance(attn, PagedAttention)
        gen = torch.Generator().manual_seed(seed + 1)
        h, nw, qkv = normed_product(gen, self.batch, self.hidden, self.qkv_rows, self.dtype)
        bias = randn(gen, self.qkv_rows, dtype=self.dtype) if self.bias else None
        if self.folded:
            qkv = fold_norm_weight(qkv, nw)
        cos_sin = cos_sin_table(gen, hd, self.dtype).to(device)
        newest = attn.seq_lens - 1
        tables = attn.block_tables.long()
        blocks = tables.gather(1, (newest // bs)[:, None])[:, 0]
        slots = blocks * bs + newest % bs  # the padded row's on block 0
        return (h.to(device), None if self.folded else nw.to(device), 1e-6, qkv.to(device),
                None if bias is None else bias.to(device), newest, cos_sin, kc, vc, slots, attn, scale)


# The projections: K not a multiple of any block (300, 1000, 1500), odd N (97, 33, 1001), every
# kernel a provider may choose by M (1-128), and a prefill-sized M.
_M = (1, 2, 3, 4, 5, 8, 16, 17, 32, 64, 100, 128)
LINEAR_CASES = [
    LinearCase(F32, 1, 97, 300),
    LinearCase(BF16, 3, 64, 1000, bias=True),
    LinearCase(F32, 17, 33, 200),
    LinearCase(BF16, 128, 96, 160),
]
LINEAR_SWEEP = [LinearCase(d, m, n, k, bias=m % 2 == 1) for d, m, (n, k) in
                itertools.product((F32, BF16), _M, ((1001, 300), (256, 1500), (33, 2048)))] + [
    LinearCase(BF16, 300, 256, 512), LinearCase(F32, 513, 97, 300)]
LINEAR_RESIDUAL_CASES = [LinearResidualCase(F32, 1, 97, 300), LinearResidualCase(BF16, 5, 64, 1000),
                         LinearResidualCase(BF16, 32, 96, 200)]
# A 0.6 B decoder layer's products at 32 rows (16 query and 8 KV heads of 64, hidden 1024, SwiGLU 3072), folded, in
# bf16: shapes a provider may give tiles of their own.
_ROWS, _HIDDEN, _INTER = 32, 1024, 3072
# A 1 B decoder layer's MLP (hidden 2048, SwiGLU 8192) in bf16: its own split of K, at the general tile's rows (8) and
# past them (64).
_HIDDEN_1B, _INTER_1B = 2048, 8192
LINEAR_RESIDUAL_SWEEP = [LinearResidualCase(d, m, n, k) for d, m, (n, k) in
                         itertools.product((F32, BF16), _M, ((1001, 300), (256, 1500)))] + [
    LinearResidualCase(BF16, _ROWS, _HIDDEN, k) for k in (_HIDDEN, _INTER)] + [
    LinearResidualCase(BF16, 64, _HIDDEN_1B, _INTER_1B)]
# With the norm's weight folded into the projection (norm_weight None): one case per kernel a provider may
# choose by M (a GEMV's few rows, a tensor-core kernel's, a library GEMM's beside the epilogue kernel).
GATE_UP_CASES = [NormGateUpCase(F32, 1, 96, 80), NormGateUpCase(BF16, 3, 200, 77), NormGateUpCase(BF16, 20, 128, 64),
                 NormGateUpCase(F32, 1, 96, 80, folded=True), NormGateUpCase(BF16, 8, 200, 77, folded=True),
                 NormGateUpCase(BF16, 20, 1500, 64, folded=True)]
GATE_UP_SWEEP = [NormGateUpCase(d, m, h, i, folded=f) for d, m, (h, i), f in
                 itertools.product((F32, BF16), _M, ((1000, 301), (256, 768)), (False, True))] + [
    NormGateUpCase(BF16, _ROWS, _HIDDEN, _INTER, folded=True),
    NormGateUpCase(BF16, 8, _HIDDEN_1B, _INTER_1B, folded=True)]
LOGITS_CASES = [NormLogitsCase(F32, 1, 96, 1000), NormLogitsCase(BF16, 3, 200, 517), NormLogitsCase(BF16, 33, 64, 300)]
LOGITS_SWEEP = [NormLogitsCase(d, m, 1024, 5003) for d, m in itertools.product((F32, BF16), _M)]
QKV_CASES = [
    NormQkvCase(F32, 1, 2, 64, 16),
    NormQkvCase(BF16, 3, 4, 128, 16, hidden=300, bias=True),
    NormQkvCase(F32, 5, 1, 64, 32, kv_heads=1),
    NormQkvCase(BF16, 24, 8, 64, 16, kv_heads=1),
    NormQkvCase(BF16, 3, 4, 128, 16, hidden=300, bias=True, folded=True),
    NormQkvCase(F32, 8, 2, 64, 16, folded=True),
    NormQkvCase(BF16, 24, 8, 64, 16, kv_heads=1, folded=True),
    NormQkvCase(F32, 20, 2, 64, 16, hidden=1500, bias=True, folded=True),
]
QKV_SWEEP = [NormQkvCase(d, m, g, hd, 16, hidden=h, bias=m % 2 == 0, folded=f) for d, m, g, hd, h, f in
             itertools.product((F32, BF16), _M, (1, 4), (64, 128), (200, 1024), (False, True))] + [
    NormQkvCase(BF16, _ROWS, 2, 64, 16, hidden=_HIDDEN, kv_heads=8, folded=True)]
# The qkv projection beside each kernel a provider may choose by M: the attention after a GEMV's or a tensor-core
# kernel's RoPE epilogue, and after a library GEMM (K > 1024 from 3 rows, any K past 16 rows), with the norm's
# weight folded or not, with a bias, over short and long contexts.
QKV_ATTENTION_CASES = [
    NormQkvAttentionCase(F32, 1, 2, 64, 16, long=70),
    NormQkvAttentionCase(BF16, 5, 4, 128, 16, hidden=1500, bias=True, folded=True, long=300),
    NormQkvAttentionCase(F32, 6, 2, 64, 32, hidden=1500, long=300),
    NormQkvAttentionCase(BF16, 3, 2, 64, 16, hidden=1500, folded=True, long=40),
    NormQkvAttentionCase(BF16, 20, 8, 64, 16, hidden=1024, kv_heads=1, folded=True, long=100),
    NormQkvAttentionCase(F32, 17, 2, 64, 16, hidden=300, bias=True, long=40),
]
QKV_ATTENTION_SWEEP = [NormQkvAttentionCase(d, m, g, hd, 16, hidden=h, bias=m % 2 == 1, folded=f)
                       for d, m, g, hd, h, f in itertools.product((F32, BF16), (1, 3, 8, 32), (1, 4), (64, 128),
                                                                  (1024, 1500), (False, True))]
# The tensor-core kernel with its weight tiles through a TMA descriptor: 2-byte weights whose rows are 16-byte
# multiples, split over K and not, and ROPE's rows (a feature and its partner, not one run of rows), which keep
# pointer loads.
DESCRIPTOR_GEMM = [
    ("linear", LinearCase(BF16, 20, 97, 256, bias=True)),
    ("linear_residual", LinearResidualCase(BF16, 33, 64, 512)),
    ("norm_gate_up_silu_mul", NormGateUpCase(BF16, 20, 96, 40)),
    ("norm_gate_up_silu_mul", NormGateUpCase(BF16, 20, 1024, 24)),
    ("norm_logits", NormLogitsCase(BF16, 17, 64, 304)),
    ("norm_qkv_rope_kv_write", NormQkvCase(BF16, 20, 2, 64, 16, hidden=128, bias=True)),
]
DESCRIPTOR_GEMM_IDS = [f"{op}-{i}" for i, (op, _) in enumerate(DESCRIPTOR_GEMM)]
