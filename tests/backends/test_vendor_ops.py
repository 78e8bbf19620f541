"""The npu and mlu op providers against recording stand-ins for torch_npu and torch_mlu_ops.

Each stand-in records every call and computes, in plain torch, what the vendor documents for it
(shapes, layouts, dtypes, the mask convention), refusing what that documentation rules out. A
test checks that a provided op hands the vendor the documented arguments and that, computed
through the stand-in, it equals corelib's reference. This shows the mapping is consistent with
the documented semantics; none of it ran on an NPU or an MLU.
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

from corelib.device import Device
from corelib.ops import OP_NAMES, PagedAttention, VarlenAttention
from corelib.ops import reference as ref

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
        if kw.get("block_table") is not None:
            out = self._paged(query, key, value, mask, heads, kv_heads, kw)
        else:
            out = self._dense(query, key, value, mask, heads, kv_heads, kw)
        return out, torch.zeros(1)

    def _paged(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, heads: int,
               kv_heads: int, kw: dict[str, Any]) -> torch.Tensor:
        # page attention, Q_S = 1, BSH query; KV (blocknum, blocksize, H) laid out by block_table
        table, block_size = kw["block_table"], kw["block_size"]
        lengths: list[int] = kw.get("actual_seq_lengths_kv") or []
        batch, num_blocks, hd = query.shape[0], key.shape[0], query.shape[2] // heads
        require(kw["input_layout"] == "BSH" and query.shape[1] == 1, "modelled: BSH with Q_S = 1")
        require(table.dtype == torch.int32 and table.shape[0] == batch, "block_table int32 [B, W]")
        require(key.dim() == 3 and key.shape[1] == block_size and block_size % 16 == 0, "(blocknum, 16k, H)")
        require(len(lengths) >= batch and all(type(n) is int for n in lengths), "kv lengths: a list of host ints")
        require(sum(math.ceil(n / block_size) for n in lengths[:batch]) <= num_blocks, "blocknum too small")
        require(table.shape[1] * block_size >= max(lengths[:batch]), "block_table narrower than the lengths")
        cache_k, cache_v = (t.view(num_blocks, block_size, kv_heads, hd) for t in (key, value))
        out = []
        for b, length in enumerate(lengths[:batch]):
            pos = torch.arange(length)
            blocks = table[b, pos // block_size].long()
            dead = torch.zeros(1, length, dtype=torch.bool) if mask is None else mask[b].reshape(1, -1)[:, :length]
            row = attend(query[b].view(1, heads, hd), cache_k[blocks, pos % block_size],
                         cache_v[blocks, pos % block_size], dead.bool(), kw["scale"])
            out.append(row.reshape(1, heads * hd))
        return torch.stack(out).to(query.dtype)  # [B, 1, H]

    def _dense(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, heads: int,
               kv_heads: int, kw: dict[str, Any]) -> torch.Tensor:
        # BSND without lengths: every row of every batch entry is computed; mask (B, 1, S, S_kv)
        require(kw["input_layout"] == "BSND" and kw.get("sparse_mode", 0) == 0, "modelled: BSND, sparse_mode 0")
        require(query.dim() == 4 and query.shape[2] == heads and key.shape[2] == kv_heads, "BSND shapes")
        batch, length, s_kv = query.shape[0], query.shape[1], key.shape[1]
        require(mask is None or mask.shape == (batch, 1, length, s_kv), "full mask (B, 1, S, S_kv)")
        out = [attend(query[b], key[b], value[b], torch.zeros(length, s_kv, dtype=torch.bool) if mask is None
                      else mask[b, 0].bool(), kw["scale"]) for b in range(batch)]
        return torch.stack(out).to(query.dtype)


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

    def flash_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: Any, cu_q: torch.Tensor,
                        cu_kv: torch.Tensor, alibi: Any, bias: Any, max_q: int, max_kv: int, scale: float,
                        causal: bool, left: int, right: int, compute_dtype: torch.dtype, lse: bool) -> Any:
        self.log("flash_attention", q=q, k=k, v=v, out=out, cu_seq_lens_q=cu_q, cu_seq_lens_kv=cu_kv,
                 max_seq_len_q=max_q, max_seq_len_kv=max_kv, softmax_scale=scale, is_causal=causal)
        require(q.dim() == 3 and k.dim() == 3 and q.dtype in HALF, "packed q/k/v, half precision")
        require(cu_q.dtype == cu_kv.dtype == torch.int32, "cu_seq_lens int32")
        require(q.stride(-1) == 1 and q.stride(-2) == q.shape[-1], "q last two dims contiguous")
        result = torch.empty_like(q) if out is None else out
        for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
            require(end - start <= max_q, "max_seq_len_q below a sequence length")
            dead = ~torch.ones(end - start, end - start, dtype=torch.bool).tril() if causal else \
                torch.zeros(end - start, end - start, dtype=torch.bool)
            result[start:end] = attend(q[start:end], k[start:end], v[start:end], dead, scale).to(q.dtype)
        return result


NO_DEVICE = cast(Device, None)  # neither provider reads the device


@pytest.fixture
def npu(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeTorchNpu, dict[str, Op]]:
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake, cast(dict[str, Op], dict(NPUBackend().op_provider().load(NO_DEVICE)))


@pytest.fixture
def mlu(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeTmo, dict[str, Op]]:
    fake = FakeTmo()
    monkeypatch.setitem(sys.modules, "torch_mlu_ops", fake)
    return fake, cast(dict[str, Op], dict(MLUBackend().op_provider().load(NO_DEVICE)))


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tolerance = 2e-2 if actual.dtype in HALF or expected.dtype in HALF else 1e-5
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)


# -- availability and the backend hooks -------------------------------------------------------


def test_providers_load_only_where_every_vendor_function_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # an import that fails
    monkeypatch.setitem(sys.modules, "torch_mlu_ops", None)
    npu_ops, mlu_ops = NPUBackend().op_provider(), MLUBackend().op_provider()
    assert "torch_npu cannot be imported" in (npu_ops.available() or "")
    assert "torch_mlu_ops cannot be imported" in (mlu_ops.available() or "")
    monkeypatch.setitem(sys.modules, "torch_npu", FakeTorchNpu())
    monkeypatch.setitem(sys.modules, "torch_mlu_ops", FakeTmo())
    assert npu_ops.available() is None and mlu_ops.available() is None
    monkeypatch.delattr(FakeTorchNpu, "npu_swiglu")
    assert npu_ops.available() == "torch_npu 2.5.1.fake lacks npu_swiglu; install a torch_npu that has them"
    assert (npu_ops.name, mlu_ops.name) == ("torch_npu", "torch_mlu_ops")
    assert set(npu_ops.op_names()) == set(OP_NAMES) - {"sample"}
    assert set(mlu_ops.op_names()) == set(OP_NAMES) - {"sample", "paged_decode_attention"}


def test_load_returns_exactly_the_named_ops(npu: tuple[FakeTorchNpu, dict[str, Op]],
                                            mlu: tuple[FakeTmo, dict[str, Op]]) -> None:
    assert tuple(npu[1]) == NPUBackend().op_provider().op_names()
    assert tuple(mlu[1]) == MLUBackend().op_provider().op_names()


# -- inputs -----------------------------------------------------------------------------------


def rope_case(hd: int, block_size: int, dtype: torch.dtype, nh: int = 8, nkv: int = 2, tokens: int = 7
              ) -> dict[str, Any]:
    g = torch.Generator().manual_seed(hd + block_size)
    fused = torch.randn(tokens, (nh + 2 * nkv) * hd, generator=g).to(dtype)  # the qkv projection
    angles = torch.outer(torch.arange(64.0), 1 / 10000 ** (torch.arange(0, hd, 2) / hd)).repeat(1, 2)
    slots = torch.randperm(4 * block_size, generator=g)[:tokens] + block_size  # never the null block 0
    return {
        "qk": fused[:, : (nh + nkv) * hd].view(tokens, nh + nkv, hd),  # strided, as the model passes it
        "v": fused[:, (nh + nkv) * hd :].view(tokens, nkv, hd),
        "positions": torch.randint(0, 64, (tokens,), generator=g),
        "cos_sin": torch.stack([angles.cos(), angles.sin()], dim=1).to(dtype),
        "k_cache": torch.randn(5, block_size, nkv, hd, generator=g).to(dtype),
        "v_cache": torch.randn(5, block_size, nkv, hd, generator=g).to(dtype),
        "slot_mapping": slots,
    }


def decode_case(hd: int, block_size: int, lengths: list[int], nh: int = 8, nkv: int = 2,
                dtype: torch.dtype = torch.bfloat16, spare_blocks: int = 3) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(hd * block_size + len(lengths))
    batch, width = len(lengths), max(math.ceil(n / block_size) for n in lengths) + 1  # one padding column
    num_blocks = batch * width + spare_blocks
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # block 0 is the null block
    tables = torch.zeros(batch, width, dtype=torch.int32)
    for b, length in enumerate(lengths):
        for column in range(math.ceil(length / block_size)):
            tables[b, column] = order.pop()
    q = torch.randn(batch, nh, hd, generator=g).to(dtype)
    k_cache, v_cache = (torch.randn(num_blocks, block_size, nkv, hd, generator=g).to(dtype) for _ in "kv")
    return q, k_cache, v_cache, tables, torch.tensor(lengths)


def varlen_case(lengths: list[int], hd: int, nh: int = 8, nkv: int = 2) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(sum(lengths) + hd)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, hd, generator=g).bfloat16() for heads in (nh, nkv, nkv))
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return q, k, v, cu_seqlens


# -- torch_npu --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (5, 4, 32)])
def test_npu_rms_norm_maps_to_npu_rms_norm_and_npu_add_rms_norm(
    npu: tuple[FakeTorchNpu, dict[str, Op]], dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    fake, ops = npu
    x, residual = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    weight = torch.rand(shape[-1]).to(dtype) + 0.5
    normed, passthrough = ops["rms_norm"](x, weight, 1e-5)
    (call,) = fake.named("npu_rms_norm")
    assert call["gamma"] is weight and call["epsilon"] == 1e-5 and torch.equal(call["x"], x)
    close(normed, ref.rms_norm(x, weight, 1e-5)[0])
    assert passthrough is x
    normed, summed = ops["rms_norm"](x, weight, 1e-5, residual)
    (call,) = fake.named("npu_add_rms_norm")
    assert torch.equal(call["x1"], x) and torch.equal(call["x2"], residual) and call["gamma"] is weight
    expected_normed, expected_sum = ref.rms_norm(x, weight, 1e-5, residual)
    close(normed, expected_normed)
    close(summed, expected_sum)


@pytest.mark.parametrize(("hd", "block_size", "dtype"), [(64, 16, torch.float32), (128, 128, torch.bfloat16)])
def test_npu_rope_kv_write_rotates_with_npu_rotary_mul_and_scatters_into_the_slots(
    npu: tuple[FakeTorchNpu, dict[str, Op]], hd: int, block_size: int, dtype: torch.dtype
) -> None:
    fake, ops = npu
    case = rope_case(hd, block_size, dtype)
    expected = {**case, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()}
    rotated = ops["rope_kv_write"](**case)
    expected_rotated = ref.rope_kv_write(**expected)
    (rope,) = fake.named("npu_rotary_mul")
    tokens, heads = case["qk"].shape[:2]
    assert rope["input"].shape == (1, tokens, heads, hd) and rope["rotary_mode"] == "half"
    assert torch.equal(rope["r1"][0, :, 0], case["cos_sin"][case["positions"], 0]), "r1 is cos at each position"
    assert torch.equal(rope["r2"][0, :, 0], case["cos_sin"][case["positions"], 1]), "r2 is sin at each position"
    k_write, v_write = fake.named("npu_scatter_nd_update_")
    assert k_write["input"].data_ptr() == case["k_cache"].data_ptr(), "the key write goes into k_cache itself"
    assert v_write["input"].data_ptr() == case["v_cache"].data_ptr()
    assert torch.equal(k_write["indices"], case["slot_mapping"].view(-1, 1))
    close(rotated, expected_rotated)
    close(case["k_cache"], expected["k_cache"])  # written slots equal, every other slot untouched
    assert torch.equal(case["v_cache"], expected["v_cache"])


@pytest.mark.parametrize(("hd", "block_size", "lengths"), [(64, 16, [1, 17, 40, 5]), (128, 128, [130, 3, 256])])
def test_npu_decode_attention_reads_the_paged_cache_in_place_and_matches_the_reference(
    npu: tuple[FakeTorchNpu, dict[str, Op]], hd: int, block_size: int, lengths: list[int]
) -> None:
    fake, ops = npu
    q, k_cache, v_cache, tables, seq_lens = decode_case(hd, block_size, lengths)
    attn = PagedAttention(block_tables=tables, seq_lens=seq_lens, block_size=block_size)
    out = ops["paged_decode_attention"](q, k_cache, v_cache, attn, 0.1)
    (call,) = fake.named("npu_fused_infer_attention_score")
    batch, width = tables.shape
    assert call["input_layout"] == "BSH" and call["query"].shape == (batch, 1, 8 * hd)
    assert call["key"].data_ptr() == k_cache.data_ptr() and call["key"].shape == (k_cache.shape[0], block_size, 2 * hd)
    assert call["block_table"] is tables and call["block_size"] == block_size
    assert (call["num_heads"], call["num_key_value_heads"], call["scale"]) == (8, 2, 0.1)
    assert call["actual_seq_lengths_kv"] == [width * block_size] * batch
    assert torch.equal(call["atten_mask"], ~attn.key_mask), "True marks the dead keys"
    close(out, ref.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), attn, 0.1))


def test_npu_decode_host_arguments_do_not_depend_on_the_lengths(npu: tuple[FakeTorchNpu, dict[str, Op]]) -> None:
    # What a captured graph bakes in (host values) must not change from step to step.
    fake, ops = npu
    q, k_cache, v_cache, tables, _ = decode_case(64, 16, [30, 9])
    for lengths in ([30, 9], [31, 1]):
        ops["paged_decode_attention"](q, k_cache, v_cache, PagedAttention(tables, torch.tensor(lengths), 16), 0.1)
    first, second = ({k: v for k, v in call.items() if not isinstance(v, torch.Tensor)}
                     for call in fake.named("npu_fused_infer_attention_score"))
    assert first == second


def test_npu_decode_outside_the_documented_limits_takes_the_reference(
    npu: tuple[FakeTorchNpu, dict[str, Op]]
) -> None:
    fake, ops = npu
    q, k_cache, v_cache, tables, seq_lens = decode_case(64, 16, [20, 33], dtype=torch.float32)
    attn = PagedAttention(tables, seq_lens, 16)
    close(ops["paged_decode_attention"](q, k_cache, v_cache, attn, 0.1),
          ref.paged_decode_attention(q, k_cache, v_cache, attn, 0.1))
    q, k_cache, v_cache, tables, seq_lens = decode_case(64, 16, [20, 33], spare_blocks=-2)
    attn = PagedAttention(tables, seq_lens, 16)  # B * W > num_blocks: the full-width length is refused
    close(ops["paged_decode_attention"](q, k_cache, v_cache, attn, 0.1),
          ref.paged_decode_attention(q, k_cache, v_cache, attn, 0.1))
    assert fake.named("npu_fused_infer_attention_score") == []


@pytest.mark.parametrize(("hd", "lengths"), [(64, [5, 1, 12]), (128, [9, 16])])
def test_npu_prefill_attention_runs_the_padded_grid_and_matches_the_reference(
    npu: tuple[FakeTorchNpu, dict[str, Op]], hd: int, lengths: list[int]
) -> None:
    fake, ops = npu
    q, k, v, cu_seqlens = varlen_case(lengths, hd)
    attn = VarlenAttention(cu_seqlens=cu_seqlens, max_seqlen=max(lengths))
    out = ops["prefill_attention"](q, k, v, attn, 0.125)
    (call,) = fake.named("npu_fused_infer_attention_score")
    n, length = len(lengths), max(lengths)
    assert call["input_layout"] == "BSND" and call["query"].shape == (n, length, 8, hd)
    assert call["key"].shape == (n, length, 2, hd) and call["atten_mask"].shape == (n, 1, length, length)
    assert "actual_seq_lengths" not in call and "actual_seq_lengths_kv" not in call, "no host copy of the lengths"
    close(out, ref.prefill_attention(q.float(), k.float(), v.float(), attn, 0.125))


def test_npu_silu_mul_maps_to_npu_swiglu(npu: tuple[FakeTorchNpu, dict[str, Op]]) -> None:
    fake, ops = npu
    x = torch.randn(6, 2 * 48)[:, :64]  # a strided view: npu_swiglu takes contiguous input only
    close(ops["silu_mul"](x), ref.silu_mul(x))
    (call,) = fake.named("npu_swiglu")
    assert call["dim"] == -1 and call["input"].shape == (6, 64)


# -- torch_mlu_ops ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(5, 64), (5, 4, 32)])
def test_mlu_rms_norm_maps_to_fused_rms_norm(mlu: tuple[FakeTmo, dict[str, Op]], shape: tuple[int, ...]) -> None:
    fake, ops = mlu
    x, residual, weight = torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16(), torch.rand(shape[-1]).bfloat16()
    normed, passthrough = ops["rms_norm"](x, weight, 1e-6)
    close(normed, ref.rms_norm(x, weight, 1e-6)[0])
    assert passthrough is x
    normed, summed = ops["rms_norm"](x, weight, 1e-6, residual)
    expected_normed, expected_sum = ref.rms_norm(x, weight, 1e-6, residual)
    close(normed, expected_normed)
    close(summed, expected_sum)
    plain, fused = fake.named("fused_rms_norm")
    assert plain["residual"] is None and not plain["store"] and plain["x"].shape == (math.prod(shape[:-1]), shape[-1])
    assert fused["store"] and fused["gamma"] is weight and fused["eps"] == 1e-6


@pytest.mark.parametrize(
    ("hd", "block_size", "dtype", "dense"), [(64, 16, torch.float32, False), (128, 128, torch.bfloat16, True)]
)
def test_mlu_rope_kv_write_rotates_a_private_copy_with_apply_rotary(
    mlu: tuple[FakeTmo, dict[str, Op]], hd: int, block_size: int, dtype: torch.dtype, dense: bool
) -> None:
    fake, ops = mlu
    case = rope_case(hd, block_size, dtype)
    if dense:  # a contiguous qk is what an in-place rotation would overwrite
        case["qk"] = case["qk"].contiguous()
    untouched = case["qk"].clone()
    expected = {**case, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()}
    rotated = ops["rope_kv_write"](**case)
    expected_rotated = ref.rope_kv_write(**expected)
    (call,) = fake.named("apply_rotary")
    assert not call["interleaved"] and call["max_seqlen"] == case["qk"].shape[0], "rotate-half, one row per token"
    assert torch.equal(call["sin"], case["cos_sin"][case["positions"], 1])
    assert torch.equal(case["qk"], untouched), "the caller's qk is not rotated in place"
    close(rotated, expected_rotated)
    close(case["k_cache"], expected["k_cache"])
    assert torch.equal(case["v_cache"], expected["v_cache"])


@pytest.mark.parametrize(("hd", "lengths"), [(64, [5, 1, 12]), (128, [9, 16])])
def test_mlu_prefill_attention_maps_to_packed_flash_attention(
    mlu: tuple[FakeTmo, dict[str, Op]], hd: int, lengths: list[int]
) -> None:
    fake, ops = mlu
    q, k, v, cu_seqlens = varlen_case(lengths, hd)
    attn = VarlenAttention(cu_seqlens=cu_seqlens, max_seqlen=max(lengths))
    out = ops["prefill_attention"](q, k, v, attn, 0.125)
    (call,) = fake.named("flash_attention")
    assert call["is_causal"] and call["max_seq_len_q"] == call["max_seq_len_kv"] == max(lengths)
    assert torch.equal(call["cu_seq_lens_q"], cu_seqlens.int()) and call["softmax_scale"] == 0.125
    close(out, ref.prefill_attention(q.float(), k.float(), v.float(), attn, 0.125))


def test_mlu_silu_mul_maps_to_gated_active(mlu: tuple[FakeTmo, dict[str, Op]]) -> None:
    fake, ops = mlu
    x = torch.randn(6, 64).bfloat16()
    close(ops["silu_mul"](x), ref.silu_mul(x))
    (call,) = fake.named("active")
    assert call["act_mode"] == "silu" and call["is_gated"]
