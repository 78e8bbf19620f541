"""The fused ops of the decode layer: one projection kernel each, with its prologue and epilogue.

Where ``kernel_for`` picks cuBLAS (more rows than the GEMV pays for), each op runs as the
composition it fuses, with this provider's own kernels around the cuBLAS product: the same
results, a few more launches. Where the norm's weight is folded into the projection's
(``norm_weight`` None, as the engine folds it for this provider), cuBLAS multiplies the rows of h
themselves and the kernel after it (RoPE and the KV write, or SiLU-and-multiply) scales each
product row by its 1/rms: no norm kernel runs before the product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from corelib.ops.spec import PagedAttention
from corelib_cuda.triton_ops import linear
from corelib_cuda.triton_ops import projection as proj
from corelib_cuda.triton_ops.activation import silu_mul
from corelib_cuda.triton_ops.common import check
from corelib_cuda.triton_ops.decode_attention import Rope, paged_decode_attention
from corelib_cuda.triton_ops.linear import Kernel, Projection, kernel_for, rows_of
from corelib_cuda.triton_ops.norm import rms_norm
from corelib_cuda.triton_ops.paged_attention import paged_attention
from corelib_cuda.triton_ops.rope import rope_kv_write


def _norm_weight(op: str, h: torch.Tensor, norm_weight: torch.Tensor | None) -> None:
    """A norm weight of h's width and dtype; None: folded into the projection (a unit weight)."""
    if norm_weight is not None:
        check(norm_weight.shape == (h.shape[-1],) and norm_weight.dtype == h.dtype, op,
              f"norm_weight is {norm_weight.dtype} {tuple(norm_weight.shape)}; expected {h.dtype} ({h.shape[-1]},)")


def norm_gate_up_silu_mul(h: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                          gate_up_weight: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    # h [M, H], gate_up [2I, H] -> silu(gate) * up [M, I]
    op = "norm_gate_up_silu_mul"
    x = rows_of(op, h, gate_up_weight)
    _norm_weight(op, h, norm_weight)
    check(gate_up_weight.shape[0] % 2 == 0, op, f"gate_up has {gate_up_weight.shape[0]} rows; expected 2 I")
    inter = gate_up_weight.shape[0] // 2
    kernel = kernel_for(x.shape[0], 2 * inter, x.shape[1], gate_up_weight.element_size())
    if kernel is Kernel.CUBLAS:
        if norm_weight is None:  # folded: the SiLU kernel scales the product by the rows' 1/rms
            return silu_mul(F.linear(x, gate_up_weight), rows=x, eps=eps)
        return silu_mul(F.linear(rms_norm(x, norm_weight, eps)[0], gate_up_weight))
    out = torch.empty((x.shape[0], inter), dtype=h.dtype, device=h.device)
    return Projection(proj.SILU, x, gate_up_weight, out, inter, paired=True, pair_offset=inter, norm_weight=norm_weight,
                      eps=eps, unit_norm=norm_weight is None).run(kernel, pdl)


def norm_logits(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, *, pdl: bool = False
                ) -> torch.Tensor:
    # h [M, H], weight [V, H] -> float32 logits [M, V]
    x = rows_of("norm_logits", h, weight)
    _norm_weight("norm_logits", h, norm_weight)
    kernel = kernel_for(x.shape[0], weight.shape[0], x.shape[1], weight.element_size())
    if kernel is Kernel.CUBLAS:
        normed = rms_norm(x, norm_weight, eps)[0]
        if linear.TUNING.gemm_float_logits and normed.is_cuda and normed.dtype in (torch.bfloat16, torch.float16):
            # cuBLAS writes float32 itself (its accumulation, unrounded): no bf16 logits to widen in a kernel after
            return torch.mm(normed, weight.t(), out_dtype=torch.float32)
        return F.linear(normed, weight).float()
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32, device=h.device)
    return Projection(proj.LOGITS, x, weight, out, weight.shape[0], norm_weight=norm_weight, eps=eps).run(kernel, pdl)


def norm_qkv_rope_kv_write(
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
    *,
    pdl: bool = False,
) -> torch.Tensor:
    # h [B, H], qkv [(nh + 2 nkv) hd, H], caches [NB, bs, nkv, hd] -> rotated q [B, nh, hd]
    op = "norm_qkv_rope_kv_write"
    x = rows_of(op, h, qkv_weight)
    _norm_weight(op, h, norm_weight)
    nh, nkv, hd = _qkv_heads(op, x, qkv_weight, qkv_bias, positions, cos_sin, k_cache, v_cache, slot_mapping)
    batch, rows = x.shape[0], qkv_weight.shape[0]
    kernel = kernel_for(batch, rows, x.shape[1], qkv_weight.element_size())
    if kernel is Kernel.CUBLAS:
        # Folded (no norm weight): cuBLAS multiplies h's rows themselves, and the RoPE kernel scales the product by
        # their 1/rms, then adds the bias; else the norm's kernel before the product, the bias in cuBLAS's epilogue.
        folded = norm_weight is None
        normed = x if norm_weight is None else rms_norm(x, norm_weight, eps)[0]
        qkv = F.linear(normed, qkv_weight, None if folded else qkv_bias)  # [B, (nh + 2 nkv) hd]
        qk, v = qkv[:, : (nh + nkv) * hd].view(batch, nh + nkv, hd), qkv[:, (nh + nkv) * hd :].view(batch, nkv, hd)
        return rope_kv_write(qk, v, positions, cos_sin, k_cache, v_cache, slot_mapping, rows=x if folded else None,
                             eps=eps, bias=qkv_bias if folded else None)[:, :nh]
    out = torch.empty((batch, nh, hd), dtype=h.dtype, device=h.device)
    launch = Projection(proj.ROPE, x, qkv_weight, out.view(batch, nh * hd), rows // 2, paired=True,
                        norm_weight=norm_weight, unit_norm=norm_weight is None, eps=eps, bias=qkv_bias,
                        rope=(positions, cos_sin, k_cache, v_cache, slot_mapping), heads=(nh, nkv, hd // 2))
    return launch.run(kernel, pdl).view(batch, nh, hd)


def _qkv_heads(op: str, x: torch.Tensor, qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None,
               positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slot_mapping: torch.Tensor) -> tuple[int, int, int]:
    """(nh, nkv, hd) of a qkv projection's inputs, each checked: x [B, H], the caches [NB, bs, nkv, hd]."""
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype == x.dtype, op,
          f"caches {k_cache.dtype} {tuple(k_cache.shape)} and {v_cache.dtype} {tuple(v_cache.shape)}; expected "
          f"two {x.dtype} [NB, bs, nkv, hd]")
    nkv, hd = k_cache.shape[2], k_cache.shape[3]
    rows = qkv_weight.shape[0]
    check(hd % 2 == 0 and rows % hd == 0 and rows // hd > 2 * nkv, op,
          f"qkv_weight has {rows} rows; expected (nh + 2*{nkv}) * {hd} with nh >= 1 and an even head dim")
    batch = x.shape[0]
    check(positions.shape == (batch,) and slot_mapping.shape == (batch,), op,
          f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)}; expected ({batch},)")
    check(cos_sin.dim() == 3 and cos_sin.shape[1:] == (2, hd) and cos_sin.stride(-1) == 1, op,
          f"cos_sin {tuple(cos_sin.shape)}; expected [max_len, 2, {hd}] with a contiguous last dim")
    check(k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, op, "the caches need a contiguous last dim")
    check(qkv_bias is None or qkv_bias.shape == (rows,), op, f"qkv_bias must be ({rows},)")
    return rows // hd - 2 * nkv, nkv, hd


def norm_qkv_attention(
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
    *,
    pdl: bool = False,
) -> torch.Tensor:
    # h [B, H], qkv [(nh + 2 nkv) hd, H], caches [NB, bs, nkv, hd] -> the attention's output [B, nh, hd]
    # Beside cuBLAS in a decode step of up to ``rope_in_attention_max_m`` rows, the attention kernel rotates q and k
    # and writes k and v itself: no RoPE kernel. Elsewhere (the projection kernels, which rotate in their epilogue;
    # more rows; prompt chunks) the two ops.
    op = "norm_qkv_attention"
    rows = h.numel() // max(h.shape[-1], 1)
    if (not attn.is_decode or attn.captured or rows > linear.TUNING.rope_in_attention_max_m
            or kernel_for(rows, qkv_weight.shape[0], qkv_weight.shape[-1], qkv_weight.element_size())
            is not Kernel.CUBLAS):  # the two ops, which check their own inputs
        q = norm_qkv_rope_kv_write(h, norm_weight, eps, qkv_weight, qkv_bias, positions, cos_sin, k_cache, v_cache,
                                   slot_mapping, pdl=pdl)
        return paged_attention(q, k_cache, v_cache, attn, scale, pdl=pdl)
    x = rows_of(op, h, qkv_weight)
    _norm_weight(op, h, norm_weight)
    _qkv_heads(op, x, qkv_weight, qkv_bias, positions, cos_sin, k_cache, v_cache, slot_mapping)
    folded = norm_weight is None
    normed = x if norm_weight is None else rms_norm(x, norm_weight, eps)[0]
    qkv = F.linear(normed, qkv_weight, None if folded else qkv_bias)  # [B, (nh + 2 nkv) hd]
    rope = Rope(positions, cos_sin, slot_mapping, rows=x if folded else None, eps=eps,
                bias=qkv_bias if folded else None)
    return paged_decode_attention(qkv, k_cache, v_cache, attn, scale, pdl=pdl, rope=rope)
