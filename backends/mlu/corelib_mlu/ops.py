"""Fused ops on Cambricon MLUs through torch_mlu_ops (tmo): the ``torch_mlu_ops`` op provider.

Written against torch_mlu_ops as its own callers use it and checked only against a recording
stand-in that follows those conventions (tests/backends/test_vendor_ops.py); it has not run on
an MLU.

| corelib op             | torch_mlu_ops function             | graph-safe | notes                     |
|------------------------|------------------------------------|------------|---------------------------|
| rms_norm               | fused_rms_norm                     | yes        | residual add fused        |
| rope_kv_write          | apply_rotary (+ torch index_copy_) | yes        | KV write: cache layout    |
| paged_attention        | flash_attention (packed q and kv)  | yes        | keys gathered per row     |
| silu_mul               | active(act_mode="silu", gated)     | yes        |                           |
| linear                 | matmul (trans_b)                   | yes        | bias in the epilogue      |
| linear_residual        | matmul (residual, beta = 1)        | yes        | residual in the epilogue  |
| norm_qkv_rope_kv_write | composed: the ops above            | yes        | no single tmo operator    |
| norm_gate_up_silu_mul  | composed: fused_rms_norm, matmul, active | yes  |                           |
| norm_logits            | composed: fused_rms_norm, matmul   | yes        |                           |
| norm_qkv_attention     | composed: the ops above            | yes        |                           |
| sample                 | (reference)                        | -          | plain torch already       |

Sources: the Python conventions from Cambricon/vllm-mlu vllm_mlu/_mlu_ops.py and
DeepLink-org/dlinfer dlinfer/vendor/camb/camb_ops.py (both call ``torch_mlu_ops`` as ``tmo``);
the shape, dtype and contiguity checks from jd-opensource/xllm xllm/core/kernels/mlu/*.cpp,
which wrap the same kernels in C++.

- ``fused_rms_norm(x, residual, gamma, beta, bias, eps, store_output_before_norm, quant_scale)``:
  x [T, H]; returns normed, or (normed, x + residual) when residual is given and
  store_output_before_norm is true (dlinfer's rms_norm / add_rms_norm).
- ``apply_rotary(input, sin_cache, cos_cache, position_ids, cu_seqlens, interleaved, discrete,
  dynamic_ntk, max_seqlen)``: sin before cos; interleaved=False is rotate-half ("fold", neox).
  With discrete=False, position_ids=None and an input of [1, S, heads, hd], row s of sin/cos
  [S, hd] rotates token s (dlinfer's apply_rotary_pos_emb), so the rows are gathered by position
  on the device first. vllm-mlu assigns its result back to the input, so it may rotate in
  place: it gets a private copy of qk.
- ``active(input, act_mode="silu", is_gated=True)``: silu(first half) * second half (dlinfer's
  silu_and_mul).
- ``matmul(input, filter, bias, residual, act_mode, alpha, beta, use_fast, approximate, ...,
  trans_b)``: alpha * (input @ filter' + bias) + beta * residual, then the activation; input
  [m, k], filter [n, k] with trans_b=True, residual [m, n], fp16/bf16/fp32 (the Torch-MLU-Ops
  user guide, torch_mlu_ops.matmul; the call as xpu_graph's dense layer makes it). The residual
  add happens before the one rounding to the output dtype, which the reference does after
  rounding the product: within the dtype's tolerance.
- ``flash_attention(q, k, v, out, cu_seq_lens_q, cu_seq_lens_kv, alibi_slope, attn_bias,
  max_seq_len_q, max_seq_len_kv, softmax_scale, is_causal, window_size_left, window_size_right,
  compute_dtype, return_lse)``: packed q [T, nh, hd], k/v [K, nkv, hd], cu_seq_lens [n+1] int32
  on the device (vllm-mlu's query_start_loc), causal within each sequence.
- paged attention (a step's queries over each row's cached keys, 1 or more per row) is the
  same ``flash_attention`` with cu_seq_lens_q = the step's query starts and cu_seq_lens_kv = the
  cumulative sequence lengths, causal: a row's queries are its last tokens, the mask aligned to
  the bottom right, as vllm-mlu's prefix-cached prefill calls it. Its paged form (the block_tables
  argument) wants caches of [num_blocks, num_kv_heads, block_size, head_dim]; vllm-mlu's int8 path
  gathers the keys into packed [total, nkv, hd] runs and passes no block table, which is what this
  does for corelib's layout, into a buffer of B * W * bs rows (a static size, so no host sync).

Left on the reference, and why:
- the KV write, and the paged kernels: ``reshape_paged_cache``, ``single_query_cached_kv_attn`` and
  ``flash_attention``'s block_tables take caches of [num_blocks, num_kv_heads, block_size, head_dim]
  and check them contiguous (xllm reshape_paged_cache.cpp, single_query_cached_kv_attn.cpp);
  corelib allocates [num_blocks, block_size, num_kv_heads, head_dim], whose permuted view is not
  contiguous. They become usable once a provider may choose the cache layout;
- sampling.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Protocol, cast

import torch

from corelib.device import Device
from corelib.errors import one_line
from corelib.ops import PagedAttention
from corelib.ops import reference as ref

_HALF = (torch.float16, torch.bfloat16)
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
VENDOR_FUNCTIONS = ("fused_rms_norm", "apply_rotary", "active", "flash_attention", "matmul")


class TorchMluOps(Protocol):
    """The part of torch_mlu_ops these ops call, with the argument order its callers use."""

    def fused_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        gamma: torch.Tensor,
        beta: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        store_output_before_norm: bool,
        quant_scale: torch.Tensor | None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def apply_rotary(
        self,
        input: torch.Tensor,
        sin_cache: torch.Tensor,
        cos_cache: torch.Tensor,
        position_ids: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
        interleaved: bool,
        discrete: bool,
        dynamic_ntk: bool,
        max_seqlen: int,
    ) -> torch.Tensor: ...

    def active(self, input: torch.Tensor, act_mode: str, is_gated: bool) -> torch.Tensor: ...

    def matmul(
        self,
        input: torch.Tensor,
        filter: torch.Tensor,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None,
        act_mode: str,
        alpha: float,
        beta: float,
        use_fast: bool,
        approximate: bool,
        *,
        trans_b: bool,
    ) -> torch.Tensor: ...

    def flash_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor | None,
        cu_seq_lens_q: torch.Tensor | None,
        cu_seq_lens_kv: torch.Tensor | None,
        alibi_slope: torch.Tensor | None,
        attn_bias: torch.Tensor | None,
        max_seq_len_q: int,
        max_seq_len_kv: int,
        softmax_scale: float,
        is_causal: bool,
        window_size_left: int,
        window_size_right: int,
        compute_dtype: torch.dtype,
        return_lse: bool,
    ) -> object: ...


class MluKernels:
    """corelib's ops over the torch_mlu_ops module ``tmo``; a call outside a known limit takes the reference."""

    def __init__(self, tmo: TorchMluOps) -> None:
        self.tmo = tmo

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype not in _FLOAT or weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
            return ref.rms_norm(x, weight, eps, residual)
        flat = x.reshape(-1, x.shape[-1])  # [T, H]: the kernel takes 2-D rows
        if residual is None:
            normed = self.tmo.fused_rms_norm(flat, None, weight, None, None, eps, False, None)
            return cast(torch.Tensor, normed).view(x.shape), x
        result = self.tmo.fused_rms_norm(flat, residual.reshape(flat.shape), weight, None, None, eps, True, None)
        normed, summed = cast(tuple[torch.Tensor, torch.Tensor], result)
        return normed.view(x.shape), summed.view(x.shape)

    def rope_kv_write(
        self,
        qk: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        if qk.dtype not in _FLOAT or cos_sin.dtype != qk.dtype:
            return ref.rope_kv_write(qk, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
        tokens = qk.shape[0]
        nkv, hd = v.shape[1], v.shape[2]
        cos, sin = cos_sin[positions, 0], cos_sin[positions, 1]  # [T, hd], row t for token t
        work = qk.clone(memory_format=torch.contiguous_format)[None]  # [1, T, nh+nkv, hd], ours to rotate
        rotated = self.tmo.apply_rotary(work, sin, cos, None, None, False, False, False, tokens)[0]
        k_cache.view(-1, nkv, hd).index_copy_(0, slot_mapping, rotated[:, -nkv:])
        v_cache.view(-1, nkv, hd).index_copy_(0, slot_mapping, v)
        return rotated

    def paged_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: PagedAttention, scale: float
    ) -> torch.Tensor:
        num_kv_heads, hd = k_cache.shape[2], k_cache.shape[3]
        # A captured step knows no query lengths on the host, which flash_attention's launch needs.
        if q.dtype not in _HALF or q.shape[1] % num_kv_heads != 0 or k_cache.dtype != q.dtype or attn.captured:
            return ref.paged_attention(q, k_cache, v_cache, attn, scale)
        tables, seq_lens = attn.block_tables, attn.seq_lens
        batch, width = tables.shape
        block_size = k_cache.shape[1]
        span = width * block_size
        ends = torch.cumsum(seq_lens, 0)
        cu_kv = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)  # [B+1]: row i's keys are cu_kv[i]:cu_kv[i+1]
        packed = torch.arange(batch * span, device=q.device)  # past cu_kv[B]: spare rows, never attended
        row = torch.searchsorted(ends, packed, right=True).clamp_(max=batch - 1)
        pos = (packed - (ends[row] - seq_lens[row])).clamp_(0, span - 1)
        slots = tables[row, pos // block_size].long() * block_size + pos % block_size
        keys = k_cache.reshape(-1, num_kv_heads, hd)[slots]  # [B * W * bs, nkv, hd]
        values = v_cache.reshape(-1, num_kv_heads, hd)[slots]
        starts = attn.query_start if attn.query_start is not None else torch.arange(batch + 1, device=q.device)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self.tmo.flash_attention(
            q.contiguous(),
            keys,
            values,
            out,
            starts.to(torch.int32),
            cu_kv,
            None,
            None,
            attn.max_query_len,
            span,  # the longest a row's keys can be: fixed by the shapes
            scale,
            True,  # causal, bottom-right: each row's queries are its last tokens
            -1,
            -1,
            torch.float32,
            False,
        )
        return out

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in _FLOAT:
            return ref.silu_mul(x)
        return self.tmo.active(x.contiguous(), act_mode="silu", is_gated=True)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype not in _FLOAT or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
            return ref.linear(x, weight, bias)
        flat = x.reshape(-1, x.shape[-1]).contiguous()  # [m, k]
        out = self.tmo.matmul(flat, weight.contiguous(), bias, None, "none", 1.0, 0.0, False, False, trans_b=True)
        return out.view(*x.shape[:-1], weight.shape[0])

    def linear_residual(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if x.dtype not in _FLOAT or weight.dtype != x.dtype or residual.dtype != x.dtype:
            return ref.linear(x, weight) + residual
        return self.tmo.matmul(x.contiguous(), weight.contiguous(), None, residual.contiguous(), "none", 1.0, 1.0,
                               False, False, trans_b=True)


def _import_torch_mlu_ops() -> ModuleType:
    return importlib.import_module("torch_mlu_ops")


class MluOps:
    """The ``torch_mlu_ops`` op provider: norms, RoPE, paged attention, SiLU-and-multiply, the projections."""

    name = "torch_mlu_ops"
    live_blocks_only = False  # decode attention stays on the reference, which gathers the whole width
    folded_norms = False  # the fused ops are compositions around fused_rms_norm, which takes the weight itself

    def available(self) -> str | None:
        try:
            tmo = _import_torch_mlu_ops()
        except Exception as error:  # noqa: BLE001 - ImportError, OSError, RuntimeError alike are reasons
            return f"torch_mlu_ops cannot be imported ({one_line(error)}); install Cambricon's torch_mlu_ops"
        missing = [fn for fn in VENDOR_FUNCTIONS if not callable(getattr(tmo, fn, None))]
        if missing:
            version = getattr(tmo, "__version__", "of unknown version")
            return f"torch_mlu_ops {version} lacks {', '.join(missing)}; install a torch_mlu_ops that has them"
        return None

    def op_names(self) -> tuple[str, ...]:
        return ("rms_norm", "rope_kv_write", "paged_attention", "silu_mul", "linear", "linear_residual")

    def load(self, device: Device) -> Mapping[str, object]:
        kernels = MluKernels(cast(TorchMluOps, _import_torch_mlu_ops()))
        return {name: getattr(kernels, name) for name in self.op_names()}
