"""Fused ops on Ascend NPUs through torch_npu: the ``torch_npu`` op provider.

Written against torch_npu's documented API and checked only against a recording stand-in that
follows that documentation (tests/backends/test_vendor_ops.py); it has not run on an NPU.

| corelib op             | torch_npu function                      | graph-safe | notes                      |
|------------------------|-----------------------------------------|------------|----------------------------|
| rms_norm               | npu_rms_norm / npu_add_rms_norm         | yes        | weight in x's dtype        |
| rope_kv_write          | npu_rotary_mul + npu_scatter_nd_update_ | yes        | cos/sin gathered on device |
| paged_attention        | npu_fused_infer_attention_score         | decode     | decode: BSH, static length |
|                        | (decode: BSH, Q_S = 1; chunks: BSND)    |            | + mask; chunks: block 128+ |
| silu_mul               | npu_swiglu                              | yes        |                            |
| linear                 | npu_linear (fp16, fp32)                 | yes        | bf16: torch's matmul       |
| linear_residual        | composed: linear, then the add          | yes        | no fused vendor operator   |
| norm_qkv_rope_kv_write | composed: npu_rms_norm, linear, RoPE+KV | yes        |                            |
| norm_gate_up_silu_mul  | composed: npu_rms_norm, linear, swiglu  | yes        |                            |
| norm_logits            | composed: npu_rms_norm, linear          | yes        |                            |
| norm_qkv_attention     | composed: the row above, then attention | decode     |                            |
| sample                 | (reference)                             | -          | plain torch already        |

Vendor functions and their conventions (documentation: Ascend/op-plugin docs/context/*.md,
usage: vllm-project/vllm-ascend):

- ``npu_rms_norm(self, gamma, epsilon) -> (y, rstd)``: y = x / sqrt(mean(x^2) + eps) * gamma,
  gamma in x's dtype (docs/context/（beta）torch_npu-npu_rms_norm.md).
- ``npu_add_rms_norm(x1, x2, gamma, epsilon) -> (y, rstd, x)``: x = x1 + x2, y = RmsNorm(x) *
  gamma (hicann/ops-nn norm/add_rms_norm/README.md; the call and its output order as in
  vllm_ascend/ops/layernorm.py: ``x, _, residual = npu_add_rms_norm(x, residual, w, eps)``).
- ``npu_rotary_mul(input, r1, r2, rotary_mode='half')``: input * r1 + rotate_half(input) * r2,
  input 4-D BSND, r1/r2 1S1D (docs/context/torch_npu-npu_rotary_mul.md). The doc bounds r1/r2
  to [-1, 1]: a table scaled by an attention factor above 1 (YaRN) is outside it.
- ``npu_scatter_nd_update_(input, indices, updates)``: input[indices[i]] = updates[i] in place;
  indices int32/int64 of shape [T, 1] index dim 0; non-contiguous inputs allowed
  (docs/context/torch_npu-npu_scatter_nd_update_.md). Chosen over the ATB
  ``_npu_reshape_and_cache`` (vLLM-Ascend's KV write) because it needs no ATB library, takes
  int64 slots as corelib has them, and accepts the strided k and v views without a copy.
- ``npu_fused_infer_attention_score(query, key, value, *, atten_mask, actual_seq_lengths_kv,
  block_table, num_heads, num_key_value_heads, scale, input_layout, block_size, sparse_mode)
  -> (attention_out, softmax_lse)`` (docs/context/torch_npu-npu_fused_infer_attention_score.md):
  query/key/value must be contiguous, fp16 or bf16; atten_mask True = *not* attended; GQA needs
  num_heads % num_key_value_heads == 0 and a ratio of at most 64. Page attention: key/value as
  (blocknum, blocksize, H), block_table int32 [B, >= blocks per sequence], block_size a multiple
  of 16 for fp16/bf16 when Q_S = 1, actual_seq_lengths_kv required, and blocknum at least the
  blocks those lengths cover summed over the batch.
- ``npu_swiglu(input, dim=-1)``: swish(A) * B, A the first half along dim; contiguous input only
  (docs/context/（beta）torch_npu-npu_swiglu.md).
- ``npu_linear(input, weight, bias=None)``: input @ weight' + bias, input and weight 2-D, float32,
  float16, int32 or int8 (no bfloat16 listed), bias 1-D (docs/context/（beta）torch_npu-npu_linear.md).
  A bfloat16 projection runs torch's own matmul, which torch_npu dispatches to the NPU.
- The composed ops (the fused decode-layer ops) have no single torch_npu operator: the op
  container composes them from the ones here.

Graph capture and the KV lengths: the paged kernels torch_npu offers take the KV lengths from the
host: ``actual_seq_lengths_kv`` of the fused attention (and ``actual_seq_lengths`` of
``npu_incre_flash_attention``) is an int list, and vLLM-Ascend feeds the ATB
``_npu_paged_attention`` its ``context_lens`` as a host tensor (``seq_lens_cpu``). vLLM-Ascend
keeps them current in a captured graph by re-issuing each attention in its own task group with
``graph_task_update_begin/end`` every step (vllm_ascend/compilation/acl_graph.py). corelib's
``PagedAttention`` carries the lengths only on the device, and a ``.tolist()`` would be a host
sync inside the decode loop, so decode attention here passes a *static* length, the full table
span W * bs for every row (fixed by the shapes, so a captured graph replays it correctly), and
masks the dead positions with a device mask derived from ``seq_lens``. The price: it reads all W
blocks of each row, not only the live ones, and the blocknum rule above becomes
B * W <= num_blocks; a batch that breaks it, or any other documented limit, takes the reference
for that call. The TorchAir-only ``npu_fused_infer_attention_score_v2`` takes device lengths, but
only in TorchAir's compiled graph mode, which corelib does not use.

Paged attention with several queries per row (prefill chunks and decode rows in one step) takes
the same kernel's PromptFlashAttention branch (Q_S > 1) over the paged cache: the queries as a
padded BSND grid [B, L, nh, hd], key/value as (blocknum, blocksize, H) with the block table, the
static length W * bs per row, and a device mask [B, 1, L, W * bs] that is causal within the
chunk and hides the dead keys. The documentation bounds page attention with Q_S > 1 to block
sizes that are multiples of 128, from 128 to 512, and asks KV_S >= maxBlockNumPerSeq * blockSize
when a mask is passed (the mask spans W * bs, so it holds); other block sizes take the reference.
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
_MAX_GQA_RATIO = 64
VENDOR_FUNCTIONS = (
    "npu_rms_norm",
    "npu_add_rms_norm",
    "npu_rotary_mul",
    "npu_scatter_nd_update_",
    "npu_fused_infer_attention_score",
    "npu_swiglu",
    "npu_linear",
)


class TorchNpuOps(Protocol):
    """The part of the torch_npu module these ops call, as documented (see the module docstring)."""

    def npu_rms_norm(
        self, input: torch.Tensor, gamma: torch.Tensor, epsilon: float = ...
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def npu_add_rms_norm(
        self, x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = ...
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def npu_rotary_mul(
        self, input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = ...
    ) -> torch.Tensor: ...

    def npu_scatter_nd_update_(
        self, input: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor
    ) -> torch.Tensor: ...

    def npu_fused_infer_attention_score(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        atten_mask: torch.Tensor | None = ...,
        actual_seq_lengths_kv: list[int] | None = ...,
        block_table: torch.Tensor | None = ...,
        num_heads: int = ...,
        scale: float = ...,
        input_layout: str = ...,
        num_key_value_heads: int = ...,
        sparse_mode: int = ...,
        block_size: int = ...,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def npu_swiglu(self, input: torch.Tensor, dim: int = ...) -> torch.Tensor: ...

    def npu_linear(
        self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = ...
    ) -> torch.Tensor: ...


def _gqa_supported(num_heads: int, num_kv_heads: int) -> bool:
    return num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= _MAX_GQA_RATIO


class NpuKernels:
    """corelib's ops over the torch_npu module ``npu``; a call outside a documented limit takes the reference."""

    def __init__(self, npu: TorchNpuOps) -> None:
        self.npu = npu

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # gamma must share x's dtype; the reference would promote a wider weight instead
        if x.dtype not in _FLOAT or weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
            return ref.rms_norm(x, weight, eps, residual)
        if residual is None:
            normed, _ = self.npu.npu_rms_norm(x.contiguous(), weight, epsilon=eps)
            return normed, x
        normed, _, summed = self.npu.npu_add_rms_norm(x.contiguous(), residual.contiguous(), weight, eps)
        return normed, summed

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
        nkv, hd = v.shape[1], v.shape[2]
        cos = cos_sin[positions, 0][None, :, None, :]  # [1, T, 1, hd]: 1S1D for a BSND input
        sin = cos_sin[positions, 1][None, :, None, :]
        rotated = self.npu.npu_rotary_mul(qk.contiguous()[None], cos, sin, rotary_mode="half")[0]  # [T, nh+nkv, hd]
        slots = slot_mapping.view(-1, 1)  # [T, 1]: each index picks one row of the flat [NB*bs, nkv, hd] cache
        self.npu.npu_scatter_nd_update_(k_cache.view(-1, nkv, hd), slots, rotated[:, -nkv:])
        self.npu.npu_scatter_nd_update_(v_cache.view(-1, nkv, hd), slots, v)
        return rotated

    def _decode_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: PagedAttention, scale: float
    ) -> torch.Tensor:
        batch, num_heads, hd = q.shape
        num_blocks, block_size, num_kv_heads = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
        width = attn.block_tables.shape[1]
        supported = (
            q.dtype in _HALF
            and _gqa_supported(num_heads, num_kv_heads)
            and block_size % 16 == 0
            and batch * width <= num_blocks  # the static length covers W blocks per row
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
        )
        if not supported:
            return ref.decode_attention(q, k_cache, v_cache, attn, scale)
        span = width * block_size
        out, _ = self.npu.npu_fused_infer_attention_score(
            q.contiguous().view(batch, 1, num_heads * hd),  # BSH, S = 1
            k_cache.view(num_blocks, block_size, num_kv_heads * hd),  # (blocknum, blocksize, H): no copy
            v_cache.view(num_blocks, block_size, num_kv_heads * hd),
            atten_mask=attn.key_mask.logical_not(),  # [B, 1, 1, W*bs], True where the key is dead
            actual_seq_lengths_kv=[span] * batch,  # fixed by the shapes: safe to bake into a graph
            block_table=attn.block_tables,
            num_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            scale=scale,
            input_layout="BSH",
            block_size=block_size,
        )
        return out.view(batch, num_heads, hd)

    def paged_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: PagedAttention, scale: float
    ) -> torch.Tensor:
        if attn.captured:  # the fused attention takes its lengths on the host: a captured step knows none
            return ref.paged_attention(q, k_cache, v_cache, attn, scale)
        if attn.is_decode:
            return self._decode_attention(q, k_cache, v_cache, attn, scale)
        if attn.decode_rows:  # the decode rows through the Q_S = 1 branch, the chunks through Q_S > 1
            decode, chunks = attn.split()
            d = attn.decode_rows
            return torch.cat([self._decode_attention(q[:d], k_cache, v_cache, decode, scale),
                              self.paged_attention(q[d:], k_cache, v_cache, chunks, scale)])
        tokens, num_heads, hd = q.shape
        num_blocks, block_size, num_kv_heads = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
        batch, width = attn.block_tables.shape
        supported = (
            q.dtype in _HALF
            and _gqa_supported(num_heads, num_kv_heads)
            and block_size % 128 == 0 and block_size <= 512  # page attention with Q_S > 1
            and hd % 16 == 0
            and batch * width <= num_blocks  # the static length covers W blocks per row
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
        )
        if not supported:
            return ref.paged_attention(q, k_cache, v_cache, attn, scale)
        span = width * block_size
        grid = ref.QueryGrid.of(attn, tokens, span)
        out, _ = self.npu.npu_fused_infer_attention_score(
            q[grid.index],  # [B, L, nh, hd] BSND, fresh and contiguous
            k_cache.view(num_blocks, block_size, num_kv_heads * hd),  # (blocknum, blocksize, H): no copy
            v_cache.view(num_blocks, block_size, num_kv_heads * hd),
            atten_mask=grid.visible.logical_not()[:, None],  # [B, 1, L, W*bs], True where not attended
            actual_seq_lengths_kv=[span] * batch,  # fixed by the shapes, as in decode
            block_table=attn.block_tables,
            num_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            scale=scale,
            input_layout="BSND",
            block_size=block_size,
            sparse_mode=0,  # the full mask as given
        )
        return grid.unpad(out)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in _FLOAT:
            return ref.silu_mul(x)
        return self.npu.npu_swiglu(x.contiguous(), dim=-1)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # npu_linear lists float32 and float16 (and integers); anything else takes torch's matmul
        same = weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype)
        if x.dtype not in (torch.float16, torch.float32) or not same:
            return ref.linear(x, weight, bias)
        flat = x.reshape(-1, x.shape[-1])  # [m, k]
        return self.npu.npu_linear(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])


def _import_torch_npu() -> ModuleType:
    return importlib.import_module("torch_npu")


class NpuOps:
    """The ``torch_npu`` op provider: every op but sampling, through torch_npu's fused kernels."""

    name = "torch_npu"
    live_blocks_only = False  # lengths are static per graph: every row reads the width it is given, masked
    folded_norms = False  # the fused ops are compositions around npu_rms_norm, which takes the weight itself

    def available(self) -> str | None:
        try:
            npu = _import_torch_npu()
        except Exception as error:  # noqa: BLE001 - ImportError, OSError, RuntimeError alike are reasons
            return f"torch_npu cannot be imported ({one_line(error)})"
        missing = [fn for fn in VENDOR_FUNCTIONS if not callable(getattr(npu, fn, None))]
        if missing:
            version = getattr(npu, "__version__", "of unknown version")
            return f"torch_npu {version} lacks {', '.join(missing)}; install a torch_npu that has them"
        return None

    def op_names(self) -> tuple[str, ...]:
        return ("rms_norm", "rope_kv_write", "paged_attention", "silu_mul", "linear")

    def load(self, device: Device) -> Mapping[str, object]:
        kernels = NpuKernels(cast(TorchNpuOps, _import_torch_npu()))
        return {name: getattr(kernels, name) for name in self.op_names()}
