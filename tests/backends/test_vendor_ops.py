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
from typing import Any

import pytest
import torch
from corelib_mlu.backend import MLUBackend
from corelib_npu.backend import NPUBackend
from vendorkit import FakeTmo, FakeTorchNpu, Op, close, install_mlu, install_npu

from corelib.ops import COMPOSED_OPS, OP_NAMES, PagedAttention
from corelib.ops import reference as ref
from corelib.testing.op_cases import BF16, ChunkCase, DecodeCase


@pytest.fixture
def npu(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeTorchNpu, dict[str, Op]]:
    return install_npu(monkeypatch)


@pytest.fixture
def mlu(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeTmo, dict[str, Op]]:
    return install_mlu(monkeypatch)


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
    composed = set(COMPOSED_OPS)
    assert set(npu_ops.op_names()) == set(OP_NAMES) - {"sample"} - composed
    assert set(mlu_ops.op_names()) == set(OP_NAMES) - {"sample"} - composed | {
        "linear_residual"}


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
def test_npu_paged_attention_of_a_decode_step_reads_the_paged_cache_in_place_and_matches_the_reference(
    npu: tuple[FakeTorchNpu, dict[str, Op]], hd: int, block_size: int, lengths: list[int]
) -> None:
    fake, ops = npu
    q, k_cache, v_cache, tables, seq_lens = decode_case(hd, block_size, lengths)
    attn = PagedAttention(block_tables=tables, seq_lens=seq_lens, block_size=block_size)
    out = ops["paged_attention"](q, k_cache, v_cache, attn, 0.1)
    (call,) = fake.named("npu_fused_infer_attention_score")
    batch, width = tables.shape
    assert call["input_layout"] == "BSH" and call["query"].shape == (batch, 1, 8 * hd)
    assert call["key"].data_ptr() == k_cache.data_ptr() and call["key"].shape == (k_cache.shape[0], block_size, 2 * hd)
    assert call["block_table"] is tables and call["block_size"] == block_size
    assert (call["num_heads"], call["num_key_value_heads"], call["scale"]) == (8, 2, 0.1)
    assert call["actual_seq_lengths_kv"] == [width * block_size] * batch
    assert torch.equal(call["atten_mask"], ~attn.key_mask), "True marks the dead keys"
    close(out, ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), attn, 0.1))


def test_npu_decode_host_arguments_do_not_depend_on_the_lengths(npu: tuple[FakeTorchNpu, dict[str, Op]]) -> None:
    # What a captured graph bakes in (host values) must not change from step to step.
    fake, ops = npu
    q, k_cache, v_cache, tables, _ = decode_case(64, 16, [30, 9])
    for lengths in ([30, 9], [31, 1]):
        ops["paged_attention"](q, k_cache, v_cache, PagedAttention(tables, torch.tensor(lengths), 16), 0.1)
    first, second = ({k: v for k, v in call.items() if not isinstance(v, torch.Tensor)}
                     for call in fake.named("npu_fused_infer_attention_score"))
    assert first == second


def test_npu_decode_outside_the_documented_limits_takes_the_reference(
    npu: tuple[FakeTorchNpu, dict[str, Op]]
) -> None:
    fake, ops = npu
    q, k_cache, v_cache, tables, seq_lens = decode_case(64, 16, [20, 33], dtype=torch.float32)
    attn = PagedAttention(tables, seq_lens, 16)
    close(ops["paged_attention"](q, k_cache, v_cache, attn, 0.1),
          ref.paged_attention(q, k_cache, v_cache, attn, 0.1))
    q, k_cache, v_cache, tables, seq_lens = decode_case(64, 16, [20, 33], spare_blocks=-2)
    attn = PagedAttention(tables, seq_lens, 16)  # B * W > num_blocks: the full-width length is refused
    close(ops["paged_attention"](q, k_cache, v_cache, attn, 0.1),
          ref.paged_attention(q, k_cache, v_cache, attn, 0.1))
    assert fake.named("npu_fused_infer_attention_score") == []


def chunk_args(case: ChunkCase | DecodeCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedAttention, float]:
    q, k_cache, v_cache, attn, scale, _ = case.build(0, torch.device("cpu"))
    assert isinstance(q, torch.Tensor) and isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)
    assert isinstance(attn, PagedAttention) and isinstance(scale, float)
    return q, k_cache, v_cache, attn, scale


def test_npu_paged_attention_runs_chunks_through_page_attention_and_matches_the_reference(
    npu: tuple[FakeTorchNpu, dict[str, Op]]
) -> None:
    fake, ops = npu
    q, k_cache, v_cache, attn, scale = chunk_args(ChunkCase(BF16, 4, 64, 128, ((0, 17), (130, 40), (50, 1))))
    out = ops["paged_attention"](q, k_cache, v_cache, attn, scale)
    (call,) = fake.named("npu_fused_infer_attention_score")
    batch, width = attn.block_tables.shape
    assert call["input_layout"] == "BSND" and call["query"].shape == (batch, 40, 8, 64), "a padded query grid"
    assert call["key"].data_ptr() == k_cache.data_ptr() and call["block_table"] is attn.block_tables
    assert call["actual_seq_lengths_kv"] == [width * 128] * batch, "a length fixed by the shapes, not the lengths"
    assert call["atten_mask"].shape == (batch, 1, 40, width * 128) and call["sparse_mode"] == 0
    close(out, ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), attn, scale))


def test_npu_paged_attention_of_decode_rows_is_the_decode_kernel_and_small_blocks_take_the_reference(
    npu: tuple[FakeTorchNpu, dict[str, Op]]
) -> None:
    fake, ops = npu
    q, k_cache, v_cache, attn, scale = chunk_args(DecodeCase(BF16, 3, 4, 64, 16, long=70))
    close(ops["paged_attention"](q, k_cache, v_cache, attn, scale),
          ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), attn, scale))
    (call,) = fake.named("npu_fused_infer_attention_score")
    assert call["input_layout"] == "BSH", "one query per row: the IncreFlashAttention branch"
    q, k_cache, v_cache, attn, scale = chunk_args(ChunkCase(BF16, 4, 64, 16, ((0, 17), (30, 5))))
    close(ops["paged_attention"](q, k_cache, v_cache, attn, scale),
          ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), attn, scale))
    assert len(fake.named("npu_fused_infer_attention_score")) == 1, "blocks of 16 with Q_S > 1: the reference"


def test_npu_paged_attention_runs_named_decode_rows_as_a_decode_step_and_the_chunks_apart(
    npu: tuple[FakeTorchNpu, dict[str, Op]]
) -> None:
    fake, ops = npu
    q, k_cache, v_cache, attn, scale = chunk_args(ChunkCase(BF16, 4, 64, 128, ((90, 1), (300, 1), (0, 40)),
                                                            split=True))
    assert attn.decode_rows == 2
    close(ops["paged_attention"](q, k_cache, v_cache, attn, scale),
          ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), attn, scale))
    decode, chunk = fake.named("npu_fused_infer_attention_score")
    assert decode["input_layout"] == "BSH" and decode["query"].shape == (2, 1, 8 * 64)
    assert chunk["input_layout"] == "BSND" and chunk["query"].shape == (1, 40, 8, 64)


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


@pytest.mark.parametrize("case", [ChunkCase(BF16, 2, 64, 16, ((0, 17), (30, 5), (40, 1), (16, 16))),
                                  DecodeCase(BF16, 3, 4, 64, 16, long=70)], ids=["chunks", "decode"])
def test_mlu_paged_attention_maps_to_flash_attention_over_packed_keys(
    mlu: tuple[FakeTmo, dict[str, Op]], case: ChunkCase | DecodeCase
) -> None:
    fake, ops = mlu
    q, k_cache, v_cache, attn, scale = chunk_args(case)
    out = ops["paged_attention"](q, k_cache, v_cache, attn, scale)
    (call,) = fake.named("flash_attention")
    batch, width = attn.block_tables.shape
    ends = torch.cumsum(attn.seq_lens, 0)
    assert call["is_causal"] and call["max_seq_len_q"] == attn.max_query_len
    assert call["max_seq_len_kv"] == width * 16 and call["k"].shape[0] == batch * width * 16, "static sizes"
    assert torch.equal(call["cu_seq_lens_kv"], torch.cat([ends.new_zeros(1), ends]).int())
    close(out, ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), attn, scale))


def test_mlu_silu_mul_maps_to_gated_active(mlu: tuple[FakeTmo, dict[str, Op]]) -> None:
    fake, ops = mlu
    x = torch.randn(6, 64).bfloat16()
    close(ops["silu_mul"](x), ref.silu_mul(x))
    (call,) = fake.named("active")
    assert call["act_mode"] == "silu" and call["is_gated"]
