"""Recording stand-ins for torch_npu and torch_mlu_ops, and how a test installs them.

Each stand-in records every call and computes, in plain torch, what the vendor documents for it
(shapes, layouts, dtypes, the mask convention), refusing what that documentation rules out.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F
from corelib_mlu.backend import MLUBackend
from corelib_npu.backend import NPUBackend

from corelib.platform.device import Device

HALF = (torch.float16, torch.bfloat16)
Op = Callable[..., Any]


class Refused(Exception):
    """The stand-in's version of a vendor error: the documentation does not allow the call."""


def require(condition: bool, what: str) -> None:
    if not condition:
        raise Refused(what)


class Recording:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def log(self, name: str, **arguments: Any) -> None:
        self.calls.append((name, arguments))

    def named(self, name: str) -> list[dict[str, Any]]:
        return [arguments for called, arguments in self.calls if called == name]


def rms(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    # RmsNorm(x) = x / sqrt(mean(x^2) + eps) * g, in float32
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, dead: torch.Tensor, scale: float) -> torch.Tensor:
    # q [S, nh, hd], keys/values [K, nkv, hd], dead [S, K] True = not attended -> [S, nh, hd]
    group = q.shape[1] // keys.shape[1]  # query head j reads KV head j // group
    k, v = (t.float().repeat_interleave(group, dim=1) for t in (keys, values))
    scores = torch.einsum("shd,khd->hsk", q.float(), k) * scale
    probs = scores.masked_fill(dead[None], float("-inf")).softmax(dim=-1)
    return torch.einsum("hsk,khd->shd", probs, v)


class FakeTorchNpu(Recording):
    """torch_npu's npu_* kernels as documented in Ascend/op-plugin docs/context."""

    __version__ = "2.5.1.fake"

    def npu_rms_norm(self, x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, ...]:
        self.log("npu_rms_norm", x=x, gamma=gamma, epsilon=epsilon)
        require(gamma.dtype == x.dtype, "gamma must have self's dtype")
        return rms(x, gamma, epsilon).to(x.dtype), torch.zeros(1)

    def npu_add_rms_norm(
        self, x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
    ) -> tuple[torch.Tensor, ...]:
        self.log("npu_add_rms_norm", x1=x1, x2=x2, gamma=gamma, epsilon=epsilon)
        summed = x1.float() + x2.float()
        return rms(summed, gamma, epsilon).to(x1.dtype), torch.zeros(1), summed.to(x1.dtype)

    def npu_rotary_mul(self, x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> Any:
        self.log("npu_rotary_mul", input=x, r1=r1, r2=r2, rotary_mode=rotary_mode)
        require(x.dim() == 4 and rotary_mode == "half", "input is 4-D; only half mode is modelled")
        require(r1.shape == r2.shape == (1, x.shape[1], 1, x.shape[3]), "r1/r2 are 1S1D for a BSND input")
        return (x.float() * r1.float() + rotate_half(x.float()) * r2.float()).to(x.dtype)

    def npu_scatter_nd_update_(self, var: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> Any:
        self.log("npu_scatter_nd_update_", input=var, indices=indices, updates=updates)
        depth = indices.shape[-1]
        require(indices.dtype in (torch.int32, torch.int64) and indices.dim() >= 2, "indices int32/int64, >= 2-D")
        require(updates.shape == indices.shape[:-1] + var.shape[depth:], "updates = indices[:-1] + input[a:]")
        require(bool((indices >= 0).all()) and bool((indices < var.shape[0]).all()), "indices must be in range")
        var[tuple(indices.long().unbind(-1))] = updates
        return var

    def npu_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self.log("npu_linear", input=x, weight=weight, bias=bias)
        require(x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], "2-D input and weight")
        require(x.dtype in (torch.float32, torch.float16) and weight.dtype == x.dtype, "float32 or float16")
        require(bias is None or (bias.dim() == 1 and bias.dtype == x.dtype), "1-D bias")
        out = x.float() @ weight.float().T
        return (out if bias is None else out + bias.float()).to(x.dtype)

    def npu_swiglu(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.log("npu_swiglu", input=x, dim=dim)
        require(x.is_contiguous(), "npu_swiglu does not support non-contiguous input")
        a, b = x.float().chunk(2, dim=dim)
        return (F.silu(a) * b).to(x.dtype)

    def npu_fused_infer_attention_score(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kw: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.log("npu_fused_infer_attention_score", query=query, key=key, value=value, **kw)
        require(query.dtype in HALF, "query is float16 or bfloat16")
        require(all(t.is_contiguous() for t in (query, key, value)), "query/key/value must be contiguous")
        heads, kv_heads = kw["num_heads"], kw.get("num_key_value_heads") or kw["num_heads"]
        require(heads % kv_heads == 0 and heads // kv_heads <= 64, "GQA ratio")
        mask = kw.get("atten_mask")
        require(mask is None or mask.dtype in (torch.bool, torch.int8, torch.uint8), "atten_mask bool/int8/uint8")
        require(kw.get("block_table") is not None, "modelled: page attention only (corelib passes its block tables)")
        return self._paged(query, key, value, mask, heads, kv_heads, kw), torch.zeros(1)

    def _paged(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, heads: int,
               kv_heads: int, kw: dict[str, Any]) -> torch.Tensor:
        # page attention: KV (blocknum, blocksize, H) laid out by block_table. Q_S = 1 (IncreFlashAttention):
        # BSH query; Q_S > 1 (PromptFlashAttention): BSND query, block size a multiple of 128 in [128, 512]
        table, block_size = kw["block_table"], kw["block_size"]
        lengths: list[int] = kw.get("actual_seq_lengths_kv") or []
        batch, num_blocks = query.shape[0], key.shape[0]
        if kw["input_layout"] == "BSH":
            require(query.shape[1] == 1, "modelled: BSH with Q_S = 1")
            hd, queries = query.shape[2] // heads, 1
        else:
            require(kw["input_layout"] == "BSND" and query.dim() == 4 and query.shape[2] == heads, "BSND query")
            hd, queries = query.shape[3], query.shape[1]
        if queries > 1:
            require(block_size % 128 == 0 and 128 <= block_size <= 512, "Q_S > 1 page attention: block_size 128-512")
            require(kw.get("sparse_mode", 0) == 0, "modelled: sparse_mode 0 with a full mask")
        require(table.dtype == torch.int32 and table.shape[0] == batch, "block_table int32 [B, W]")
        require(key.dim() == 3 and key.shape[1] == block_size and block_size % 16 == 0, "(blocknum, 16k, H)")
        require(len(lengths) >= batch and all(type(n) is int for n in lengths), "kv lengths: a list of host ints")
        require(sum(math.ceil(n / block_size) for n in lengths[:batch]) <= num_blocks, "blocknum too small")
        require(table.shape[1] * block_size >= max(lengths[:batch]), "block_table narrower than the lengths")
        if mask is not None and queries > 1:
            require(mask.dim() == 4 and mask.shape[:3] == (batch, 1, queries), "mask (B, 1, Q_S, KV_S)")
            require(mask.shape[3] >= table.shape[1] * block_size, "KV_S >= maxBlockNumPerSeq * blockSize")
        cache_k, cache_v = (t.view(num_blocks, block_size, kv_heads, hd) for t in (key, value))
        out = []
        for b, length in enumerate(lengths[:batch]):
            pos = torch.arange(length)
            blocks = table[b, pos // block_size].long()
            if mask is None:
                dead = torch.zeros(queries, length, dtype=torch.bool)
            else:
                dead = mask[b].reshape(queries, -1)[:, :length].bool()
            row = attend(query[b].reshape(queries, heads, hd), cache_k[blocks, pos % block_size],
                         cache_v[blocks, pos % block_size], dead, kw["scale"])
            out.append(row if queries > 1 else row.reshape(1, heads * hd))
        return torch.stack(out).to(query.dtype)  # BSH [B, 1, H] or BSND [B, Q_S, N, D]


class FakeTmo(Recording):
    """torch_mlu_ops as vllm-mlu and dlinfer call it (see corelib_mlu/ops.py)."""

    def fused_rms_norm(self, x: torch.Tensor, residual: Any, gamma: torch.Tensor, beta: Any, bias: Any, eps: float,
                       store_output_before_norm: bool, quant_scale: Any, *rest: Any) -> Any:
        self.log("fused_rms_norm", x=x, residual=residual, gamma=gamma, eps=eps, store=store_output_before_norm)
        require(x.dim() == 2 and beta is None and bias is None and quant_scale is None, "2-D x, plain rms norm")
        summed = x.float() if residual is None else x.float() + residual.float()
        normed = rms(summed, gamma, eps).to(x.dtype)
        if residual is not None and store_output_before_norm:
            return normed, summed.to(x.dtype)
        return normed

    def apply_rotary(self, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, position_ids: Any, cu_seqlens: Any,
                     interleaved: bool, discrete: bool, dynamic_ntk: bool, max_seqlen: int) -> torch.Tensor:
        self.log("apply_rotary", input=x, sin=sin, cos=cos, position_ids=position_ids, cu_seqlens=cu_seqlens,
                 interleaved=interleaved, discrete=discrete, dynamic_ntk=dynamic_ntk, max_seqlen=max_seqlen)
        require(not (discrete or dynamic_ntk) and position_ids is None and cu_seqlens is None, "modelled: padded")
        require(x.dim() == 4 and sin.shape == cos.shape == (x.shape[1], x.shape[3]), "sin/cos [S, hd] row per token")
        require(max_seqlen >= x.shape[1], "max_seqlen covers the sequence")
        rotated = x.float() * cos[None, :, None].float() + rotate_half(x.float()) * sin[None, :, None].float()
        return x.copy_(rotated)  # in place: the worst case its callers allow for

    def active(self, x: torch.Tensor, act_mode: str, is_gated: bool) -> torch.Tensor:
        self.log("active", input=x, act_mode=act_mode, is_gated=is_gated)
        require(act_mode == "silu" and is_gated, "modelled: gated silu")
        a, b = x.float().chunk(2, dim=-1)
        return (F.silu(a) * b).to(x.dtype)

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: Any, residual: Any, act_mode: str, alpha: float,
               beta: float, use_fast: bool, approximate: bool, *rest: Any, trans_b: bool = True) -> torch.Tensor:
        self.log("matmul", input=x, filter=weight, bias=bias, residual=residual, act_mode=act_mode, alpha=alpha,
                 beta=beta, trans_b=trans_b)
        require(x.dim() == 2 and weight.dim() == 2 and x.stride(-1) == 1, "2-D input, last dim contiguous")
        require(x.dtype in (*HALF, torch.float32) and weight.dtype == x.dtype, "fp16, bf16 or fp32")
        filt = weight.float().T if trans_b else weight.float()  # [k, n]
        require(filt.shape[0] == x.shape[1], "filter [n, k] with trans_b")
        require(bias is None or bias.shape in ((filt.shape[1],), (1, filt.shape[1])), "bias [1, n]")
        require(residual is None or residual.shape == (x.shape[0], filt.shape[1]), "residual [m, n]")
        out = x.float() @ filt + (0.0 if bias is None else bias.float().view(-1))
        out = alpha * out + (0.0 if residual is None else beta * residual.float())
        require(act_mode in ("none", "relu", "gelu", "silu"), "act_mode none/relu/gelu/silu")
        activated = {"none": out, "relu": F.relu(out), "gelu": F.gelu(out), "silu": F.silu(out)}[act_mode]
        return activated.to(x.dtype)

    def flash_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: Any, cu_q: torch.Tensor,
                        cu_kv: torch.Tensor, alibi: Any, bias: Any, max_q: int, max_kv: int, scale: float,
                        causal: bool, left: int, right: int, compute_dtype: torch.dtype, lse: bool) -> Any:
        # packed runs: sequence i's queries q[cu_q[i]:cu_q[i+1]], its keys k[cu_kv[i]:cu_kv[i+1]]; causal
        # aligned to the bottom right (a sequence's queries are its last tokens)
        self.log("flash_attention", q=q, k=k, v=v, out=out, cu_seq_lens_q=cu_q, cu_seq_lens_kv=cu_kv,
                 max_seq_len_q=max_q, max_seq_len_kv=max_kv, softmax_scale=scale, is_causal=causal)
        require(q.dim() == 3 and k.dim() == 3 and q.dtype in HALF, "packed q/k/v, half precision")
        require(cu_q.dtype == cu_kv.dtype == torch.int32 and cu_q.shape == cu_kv.shape, "cu_seq_lens int32 [n+1]")
        require(q.stride(-1) == 1 and q.stride(-2) == q.shape[-1], "q last two dims contiguous")
        require(int(cu_kv[-1]) <= k.shape[0], "cu_seq_lens_kv past the packed keys")
        result = torch.empty_like(q) if out is None else out
        runs = zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_kv[:-1].tolist(), cu_kv[1:].tolist(), strict=True)
        for q_start, q_end, kv_start, kv_end in runs:
            queries, keys = q_end - q_start, kv_end - kv_start
            require(queries <= max_q and keys <= max_kv, "max_seq_len below a sequence length")
            require(not causal or queries <= keys, "causal: no more queries than keys")
            offset = keys - queries
            dead = torch.ones(queries, keys, dtype=torch.bool).tril(offset).logical_not() if causal else \
                torch.zeros(queries, keys, dtype=torch.bool)
            result[q_start:q_end] = attend(q[q_start:q_end], k[kv_start:kv_end], v[kv_start:kv_end], dead,
                                           scale).to(q.dtype)
        return result


NO_DEVICE = cast(Device, None)  # neither provider reads the device


def install_npu(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeTorchNpu, dict[str, Op]]:
    """The torch_npu stand-in as the imported module, and the npu provider's ops loaded over it."""
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake, cast(dict[str, Op], dict(NPUBackend().op_provider().load(NO_DEVICE)))


def install_mlu(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeTmo, dict[str, Op]]:
    """The torch_mlu_ops stand-in as the imported module, and the mlu provider's ops loaded over it."""
    fake = FakeTmo()
    monkeypatch.setitem(sys.modules, "torch_mlu_ops", fake)
    return fake, cast(dict[str, Op], dict(MLUBackend().op_provider().load(NO_DEVICE)))


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tolerance = 2e-2 if actual.dtype in HALF or expected.dtype in HALF else 1e-5
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)


