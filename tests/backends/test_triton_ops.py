"""The op conformance suite against the cuda backend's Triton ops, in Triton's CPU interpreter.

No GPU is needed: TRITON_INTERPRET=1 runs the kernels on CPU tensors. Triton reads it when it
defines a kernel, its own library's included, so it is set here before Triton is first imported
and stays set for the process (harmless without a GPU: nothing else runs Triton kernels there).
Graph capture needs a device, so those tests skip here; on a GPU this module skips and the
backend conformance suite runs every test natively. The full sweep is marked slow.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("a CUDA device is here: the backend conformance suite runs the Triton ops natively",
                allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton was imported for a GPU earlier in this process", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="Triton is not installed (pip install 'corelib-cuda[triton]')")

import triton
from corelib_cpu.device import CpuBackend
from corelib_cuda.backend import CUDABackend
from corelib_cuda.triton_ops import TritonOps, decode_attention, layer_ops
from corelib_cuda.triton_ops import linear as projections
from corelib_cuda.triton_ops import paged_attention as attention
from corelib_cuda.triton_ops import projection as projection_kernels
from corelib_cuda.triton_ops.common import INTERPRETER_SM_COUNT
from corelib_cuda.triton_ops.decode_attention import DecodeConfig, decode_config
from corelib_cuda.triton_ops.rope import rope_kv_write
from omegaconf import OmegaConf
from support import assert_weights_through_descriptors, every

from corelib.config.schema import ModelConfig
from corelib.models.base import StepBatch
from corelib.models.hybrid import HybridState
from corelib.models.llama import KVCache, LlamaModel
from corelib.models.registry import architecture as architecture_of
from corelib.models.registry import model_shape
from corelib.models.shape import ModelShape
from corelib.models.weight_map import weight_map
from corelib.ops import OP_NAMES, PagedAttention
from corelib.ops.reference import reference_ops
from corelib.platform.backend import DeviceSpec
from corelib.platform.device import Capabilities, Device, Runtime
from corelib.startup.compose import compose_config
from corelib.testing.op_cases import BF16, F32, Case, DecodeCase, case_id
from corelib.testing.op_conformance import *  # noqa: F403
from corelib.testing.op_conformance import (
    CALLS,
    CAPTURED_CASES,
    DECODE_CASES,
    DECODE_SWEEP,
    OpTarget,
    assert_like_reference,
    assert_matches,
)
from corelib.testing.projection_cases import (
    DESCRIPTOR_GEMM,
    DESCRIPTOR_GEMM_IDS,
    QKV_ATTENTION_CASES,
    LinearCase,
    LinearResidualCase,
    NormGateUpCase,
    NormLogitsCase,
    NormQkvAttentionCase,
    NormQkvCase,
)


def _cpu() -> Device:
    return CpuBackend().open(DeviceSpec(backend="cpu", runtime=Runtime.native, capabilities=Capabilities()))


@pytest.fixture(scope="module")
def op_target() -> OpTarget:
    """The Triton ops loaded for the CPU: the interpreter's "device"; no graphs."""
    provider = TritonOps()
    reason = provider.available()
    if reason is not None:
        pytest.skip(reason)
    device = _cpu()
    return OpTarget(
        provider=provider.name,
        declared=provider.op_names(),
        loaded=provider.load(device),
        torch_device=device.torch_device,
        folded_norms=provider.folded_norms,
        device=None,
        no_graph_reason="Triton's interpreter runs kernels at once on the CPU: there is no graph to capture",
    )


def test_the_cuda_backend_offers_the_triton_ops() -> None:
    provider = CUDABackend().op_provider()
    assert provider.name == "triton" and provider.op_names() == OP_NAMES


def test_missing_triton_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now raises ImportError
    reason = TritonOps().available()
    assert reason is not None and "corelib-cuda[triton]" in reason and "\n" not in reason


def test_decode_cases_cover_the_split_k_and_one_tile_paths() -> None:
    # The merge of partial results runs only with several splits, the kernel without a key loop only
    # where no split holds more than one tile: some case must take each, and each alternative.
    def config(case: DecodeCase) -> DecodeConfig:
        span = case.width * case.block_size
        return decode_config(case.batch, case.kv_heads, case.group, case.head_dim, span, INTERPRETER_SM_COUNT)

    assert any(config(case).splits > 1 for case in DECODE_CASES)
    assert any(config(case).splits == 1 for case in DECODE_CASES)
    assert any(config(case).splits > 1 for case in DECODE_SWEEP)
    assert any(config(case).one_tile for case in DECODE_CASES)
    assert any(not config(case).one_tile for case in DECODE_CASES)


def test_a_split_reads_its_cache_blocks_before_the_wait_only_when_it_holds_one_tile() -> None:
    # bs 1, a 2,048-token table, 132 multiprocessors: 32 splits of 64 keys; bs 32: 4 splits of 512
    assert decode_config(1, 8, 2, 64, 2048, 132) == DecodeConfig(32, 16, 64, 64, 4, 2, one_tile=True)
    assert decode_config(32, 8, 2, 64, 2048, 132).one_tile is False
    assert decode_config(8, 8, 2, 64, 256, 132).one_tile is True  # a narrow graph: 4 splits of 64 keys


def test_a_short_span_is_not_split_where_the_grid_already_fills_the_multiprocessors() -> None:
    # small-0.6b's 256-token decode graph on 132 multiprocessors: bs 64 (512 programs) one split, no merge
    # kernel; bs 32 (256 programs) still splits, and so does bs 64 over a long span
    assert decode_config(64, 8, 2, 64, 256, 132) == DecodeConfig(1, 16, 64, 64, 4, 2, one_tile=False)
    assert decode_config(32, 8, 2, 64, 256, 132).splits > 1
    assert decode_config(64, 8, 2, 64, 2048, 132).splits > 1


@pytest.mark.parametrize("early", [True, False], ids=["old-keys-early", "every-key-late"])
def test_the_decode_attention_reads_the_same_keys_early_or_late(
    op_target: OpTarget, early: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A one-tile split may read the keys of earlier steps before the wait and the newest after it: the same
    # results either way. (That the newest comes after the wait is for the GPU's PDL test to show.)
    monkeypatch.setattr(decode_attention, "EARLY_KV", early)
    for case in DECODE_CASES:
        assert_like_reference(op_target.ops, case, torch.device("cpu"),
                              f"decode attention {case}, old keys {'early' if early else 'late'}", op="paged_attention")


#: the cases whose qkv product goes to cuBLAS: there the attention kernel rotates q and k and writes the cache
QKV_ON_CUBLAS = [case for case in QKV_ATTENTION_CASES if projections.kernel_for(
    case.batch, case.qkv_rows, case.hidden, case.dtype.itemsize) is projections.Kernel.CUBLAS]


def test_the_fused_attention_cases_take_every_path_of_the_kernel_beside_cublas() -> None:
    def config(case: NormQkvAttentionCase) -> DecodeConfig:
        span = DecodeCase(case.dtype, case.batch, case.group, case.head_dim, case.block_size, case.long).width
        return decode_config(case.batch, case.kv_heads, case.group, case.head_dim, span * case.block_size,
                             INTERPRETER_SM_COUNT)

    configs = [config(case) for case in QKV_ON_CUBLAS]
    assert any(c.splits > 1 for c in configs) and any(c.splits == 1 for c in configs)
    assert any(c.one_tile for c in configs) and any(not c.one_tile for c in configs)
    assert any(case.folded and case.bias for case in QKV_ON_CUBLAS) and any(not c.folded for c in QKV_ON_CUBLAS)
    assert len(QKV_ON_CUBLAS) < len(QKV_ATTENTION_CASES)  # and a case beside the projection kernels


@pytest.mark.parametrize("unwritten", [False, True], ids=["every-slot", "padded-row-unwritten"])
@pytest.mark.parametrize("case", QKV_ON_CUBLAS, ids=case_id)
def test_beside_cublas_the_attention_kernel_rotates_and_writes_the_keys_as_the_two_ops_do(
    case: NormQkvAttentionCase, unwritten: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The caches bit for bit as the RoPE kernel and the attention one after the other write them, and their output
    # within the dtype's tolerance (the newest key joins the softmax on its own, after the cache's), without the RoPE
    # kernel; a negative slot (the padded last row) writes nothing and reads the cache as they do.
    def build() -> tuple[Any, ...]:
        args = case.build(0, torch.device("cpu"))
        if unwritten:
            args[9][-1] = -1  # type: ignore[index]
        return args

    two = build()
    q = layer_ops.norm_qkv_rope_kv_write(*two[:10])
    expected = attention.paged_attention(q, two[7], two[8], two[10], two[11])

    def no_rope_kernel(*args: object, **kwargs: object) -> None:
        raise AssertionError("the RoPE kernel ran beside cuBLAS")

    monkeypatch.setattr(layer_ops, "rope_kv_write", no_rope_kernel)
    fused = build()
    actual = layer_ops.norm_qkv_attention(*fused)
    assert_matches(actual, expected, f"the attention beside cuBLAS ({case_id(case)})")
    assert torch.equal(fused[7], two[7]) and torch.equal(fused[8], two[8])


def test_past_its_rows_the_rope_kernel_runs_beside_cublas(monkeypatch: pytest.MonkeyPatch) -> None:
    case = QKV_ON_CUBLAS[0]
    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return rope_kv_write(*args, **kwargs)

    monkeypatch.setattr(layer_ops, "rope_kv_write", counted)
    for max_m, expected in ((case.batch, 0), (case.batch - 1, 1)):
        monkeypatch.setattr(projections, "TUNING", dataclasses.replace(projections.TUNING,
                                                                       rope_in_attention_max_m=max_m))
        layer_ops.norm_qkv_attention(*case.build(0, torch.device("cpu")))  # type: ignore[arg-type]
        assert len(calls) == expected, f"rows {case.batch}, rope_in_attention_max_m {max_m}: {len(calls)} RoPE kernels"


def _decode_inputs(shape: ModelShape, lengths: list[int], block_size: int) -> tuple[StepBatch, KVCache]:
    """A decode step over random cached context: each row's new token goes to its next slot."""
    gen = torch.Generator().manual_seed(7)
    width = max(-(-(n + 1) // block_size) for n in lengths)
    num_blocks = len(lengths) * width + 1
    cache = KVCache(torch.randn((shape.num_layers, 2, num_blocks, block_size, shape.num_kv_heads, shape.head_dim),
                                generator=gen).to(shape.dtype), block_size)
    tables = (1 + torch.arange(len(lengths) * width, dtype=torch.int32)).view(len(lengths), width)
    positions = torch.tensor(lengths)
    slots = tables.long().gather(1, (positions // block_size)[:, None])[:, 0] * block_size + positions % block_size
    batch = StepBatch(torch.randint(0, shape.vocab_size, (len(lengths),), generator=gen), positions, slots,
                        PagedAttention(tables, positions + 1, block_size), torch.arange(len(lengths)))
    return batch, cache


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "hybrid"])
@pytest.mark.slow
@pytest.mark.long  # a whole decode step in Triton's CPU interpreter (the op conformance suite checks each op)
def test_a_decode_step_through_the_triton_ops_gives_the_reference_logits(op_target: OpTarget,
                                                                         architecture: str) -> None:
    cfg = compose_config(["model=tiny" if architecture != "hybrid" else "model=hybrid-tiny",
                          f"model.architecture={architecture}", "model.num_layers=2"]).model
    typed = OmegaConf.to_object(cfg)
    assert isinstance(typed, ModelConfig)
    model = architecture_of(architecture).load(typed, _cpu(), None, False)
    assert isinstance(model, LlamaModel)
    results = []
    for ops in (reference_ops(), op_target.ops):
        batch, cache = _decode_inputs(model.shape, [0, 17, 40], 16)
        state = cache if architecture != "hybrid" else model.allocate_state(_cpu(), 4, 16, 3)
        if architecture == "hybrid":
            assert isinstance(state, HybridState)
            state.data = cache.data  # the same random context as the Llama-family runs
        results.append((model.forward(batch, state, ops), cache.data))
    (ref_logits, ref_cache), (logits, cache_data) = results
    assert_matches(logits, ref_logits, f"{architecture} logits through the triton ops")
    assert_matches(cache_data, ref_cache, f"{architecture} KV cache written by the triton ops")


@pytest.mark.parametrize("rows", [1, 20])  # the GEMV and the tensor-core kernel
def test_split_k_leaves_its_counters_ready_for_the_next_launch(op_target: OpTarget, rows: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Many programs wanted per multiprocessor: every shape splits K, and one counter buffer serves both calls.
    monkeypatch.setattr(projections, "TUNING", dataclasses.replace(projections.TUNING, gemv_programs_per_sm=64,
                                                                   gemm_programs_per_sm=64))
    assert projections.gemv_plan(1, 48, 512, 1, 4, INTERPRETER_SM_COUNT, projections.TUNING).split_k > 1
    ops = op_target.ops
    for seed in (0, 1):
        args: tuple[Any, ...] = LinearResidualCase(torch.float32, rows, 48, 512).build(seed, torch.device("cpu"))
        expected = reference_ops().linear_residual(*args)  # first: the op may write over the residual
        assert_matches(ops.linear_residual(*args), expected, f"split-K linear_residual, launch {seed + 1}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_two_streams_never_share_split_k_counters() -> None:
    # Two engines of one process replay their steps on two streams at once; the launches of one stream run one
    # after another and may share a counter buffer, those of two may not.
    device = torch.device("cuda", torch.cuda.current_device())
    first, second = torch.cuda.Stream(device), torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(first):
        counters = projections._counters(device, 7)
        assert projections._counters(device, 7) is counters, "one stream's launches reuse their counters"
    with torch.cuda.stream(second):
        assert projections._counters(device, 7).data_ptr() != counters.data_ptr()


def test_a_shape_measured_apart_gets_its_own_gemv_tile(op_target: OpTarget, monkeypatch: pytest.MonkeyPatch) -> None:
    # One product shape (M, N, K, sets) with a tile of its own: 64 float32 weights a program, many programs.
    own = ((1, 48, 512, 1, 256, 64),)
    tuning = dataclasses.replace(projections.TUNING, gemv_shape_tiles=own)
    general = dataclasses.replace(projections.TUNING, gemv_shape_tiles=())

    def plan(m: int, sets: int, of: projections.Tuning) -> projections.GemvPlan:
        return projections.gemv_plan(m, 48, 512, sets, 4, INTERPRETER_SM_COUNT, of)

    assert (plan(1, 1, tuning).block_n, plan(1, 1, tuning).block_k) == (1, 64)
    assert plan(1, 1, general) != plan(1, 1, tuning)
    assert plan(2, 1, tuning) == plan(2, 1, general)  # other rows, other sets: the general tile
    assert plan(1, 2, tuning) == plan(1, 2, general)
    monkeypatch.setattr(projections, "TUNING", tuning)
    args: tuple[Any, ...] = LinearResidualCase(torch.float32, 1, 48, 512).build(0, torch.device("cpu"))
    expected = reference_ops().linear_residual(*args)  # first: the op may write over the residual
    assert_matches(op_target.ops.linear_residual(*args), expected, "linear_residual on a tile of its own")


def test_the_measured_gemv_tiles_name_each_shape_once() -> None:
    shapes = [entry[:4] for entry in projections.GEMV_SHAPE_TILES]
    assert len(set(shapes)) == len(shapes)
    for m, n, k, sets, tile, per_sm in projections.GEMV_SHAPE_TILES:
        assert min(m, n, k, per_sm) >= 1 and sets in (1, 2) and tile >= 1024 and tile & (tile - 1) == 0
        assert projections.kernel_for(m, n * sets, k, 2) is projections.Kernel.GEMV, "an entry the GEMV never sees"


def _decoder_products(model: str) -> dict[str, tuple[int, int]]:
    """(weight rows N, K) of each product a decode step of ``model`` runs, from its weight map (a weight's sources
    stacked along the rows: q, k and v as one; gate and up as one)."""
    cfg = OmegaConf.to_object(compose_config([f"model={model}"]).model)
    assert isinstance(cfg, ModelConfig)
    found = weight_map(model_shape(cfg))
    products = {}
    for weight in [*found.layer(0), *found.model_weights()]:
        shapes = [found.sources[source].shape for source in weight.sources]
        if weight.name != "embed" and len(shapes[0]) == 2:
            products[weight.name] = (sum(rows for rows, _ in shapes), shapes[0][1])
    return products


def test_the_measured_tensor_core_tiles_are_products_the_models_run_up_to_their_rows() -> None:
    # Each entry must be a product the model runs: an entry of another shape is never used (two were, unseen).
    products = _decoder_products("small-0.6b")
    layer = {name: nk for name, nk in products.items() if name != "lm_head"}
    llama = _decoder_products("llama-1b")
    llama_mlp = {name: llama[name] for name in ("gate_up", "down")}
    entries = {(n, k): rows for rows, n, k, _block_k, _stages, _min_k_tiles in projections.GEMM_SHAPE_TILES}
    assert set(entries) == {*layer.values(), *llama_mlp.values()}, f"entries {sorted(entries)}"
    for name, (n, k) in layer.items():
        assert projections.kernel_for(32, n, k, 2) is projections.Kernel.GEMM, name
        assert projections.kernel_for(64, n, k, 2) is projections.Kernel.CUBLAS, name  # lost at 64 rows
        if k == 1024:  # unsplit at every row (measured shorter at bs 16 and 32), paired or not, on 132 SMs
            paired = name in ("qkv", "gate_up")
            n_out = n // 2 if paired else n
            for rows in (3, 16, 32):
                plan = projections.gemm_plan(rows, n_out, k, paired, 2, 132, projections.TUNING)
                assert plan.split_k == 1, (name, rows, plan)
    n, k = products["lm_head"]
    assert projections.kernel_for(32, n, k, 2) is projections.Kernel.CUBLAS  # no gain through the kernel
    for name, (n, k) in llama_mlp.items():  # from the GEMV's last row (its weights are large: 1) to 64
        assert projections.kernel_for(1, n, k, 2) is projections.Kernel.GEMV, name
        for rows in (2, 8, 32, 64):
            assert projections.kernel_for(rows, n, k, 2) is projections.Kernel.GEMM, (name, rows)
        assert projections.kernel_for(65, n, k, 2) is projections.Kernel.CUBLAS, name
    for name in ("qkv", "o", "lm_head"):  # K = 2048: cuBLAS past the GEMV's rows (the kernel was slower)
        n, k = llama[name]
        assert projections.kernel_for(32, n, k, 2) is projections.Kernel.CUBLAS, name


def test_llama_1bs_mlp_products_split_k_no_finer_than_their_entry_says() -> None:
    # Split to 4 K tiles a program (the general floor), gate_up and down lost to cuBLAS; 16 a program won.
    tuning = projections.TUNING
    sms = 132  # an H100's multiprocessors: the split the measurement ran
    for name in ("gate_up", "down"):
        n, k = _decoder_products("llama-1b")[name]
        paired = name == "gate_up"
        for rows in (2, 16, 32, 64):
            plan = projections.gemm_plan(rows, n // 2 if paired else n, k, paired, 2, sms, tuning)
            assert plan.k_per_split >= 16 * plan.block_k, (name, rows, plan)
            general = projections.gemm_plan(rows, n // 2 if paired else n, k, paired, 2, sms,
                                            dataclasses.replace(tuning, gemm_shape_tiles=()))
            assert general.k_per_split < plan.k_per_split, (name, rows)  # the general floor splits finer


def test_paired_halves_stack_in_one_tile_only_where_twice_the_programs_fit_one_wave() -> None:
    # small-0.6b's RoPE and SiLU pairs (48 programs for gate_up unstacked, 96 stacked) were faster stacked in the
    # step; llama-1b's gate_up (128 unstacked, 256 stacked: two waves) slower, so it keeps one half a tile each.
    tuning, sms = projections.TUNING, 132
    assert tuning.gemm_paired_stacked
    for name in ("qkv", "gate_up"):
        n, k = _decoder_products("small-0.6b")[name]
        for rows in (3, 8, 16, 32):
            plan = projections.gemm_plan(rows, n // 2, k, True, 2, sms, tuning)
            assert plan.stacked and plan.block_n == tuning.gemm_paired_block_n // 2, (name, rows, plan)
            assert triton.cdiv(rows, plan.block_m) * triton.cdiv(n // 2, plan.block_n) <= sms, (name, rows)  # one wave
        assert not projections.gemm_plan(16, n // 2, k, False, 2, sms, tuning).stacked  # not a pair
    n, k = _decoder_products("llama-1b")["gate_up"]
    for rows in (2, 16, 32, 64):
        plan = projections.gemm_plan(rows, n // 2, k, True, 2, sms, tuning)
        assert not plan.stacked and plan.block_n == tuning.gemm_paired_block_n, (rows, plan)
    off = dataclasses.replace(tuning, gemm_paired_stacked=False)
    assert not projections.gemm_plan(16, 3072, 1024, True, 2, sms, off).stacked


def test_small_06bs_down_projection_takes_the_tensor_core_kernel_from_past_the_gemv_with_the_general_tile() -> None:
    # K = 3072 is past gemm_max_k: its entry routes it to the kernel from the GEMV's last row on, not only past
    # gemm_max_m (cuBLAS ran it with a split-K reduction kernel); its own tile holds only past gemm_max_m.
    tuning = projections.TUNING
    n, k = _decoder_products("small-0.6b")["down"]
    assert k > tuning.gemm_max_k
    assert projections.kernel_for(tuning.gemv_max_m, n, k, 2) is projections.Kernel.GEMV
    for rows in (tuning.gemv_max_m + 1, 8, tuning.gemm_max_m, 32):
        assert projections.kernel_for(rows, n, k, 2) is projections.Kernel.GEMM, rows
    general = projections.gemm_plan(8, n, k, False, 2, INTERPRETER_SM_COUNT, tuning)
    assert (general.block_k, general.stages) == (tuning.gemm_block_k, tuning.gemm_stages)
    own = projections.gemm_plan(32, n, k, False, 2, INTERPRETER_SM_COUNT, tuning)
    assert (own.block_k, own.stages) == (128, 4)


def test_from_three_rows_no_decoder_product_of_either_small_model_runs_on_the_gemv() -> None:
    # The GEMV to 2 rows: from 3, small-0.6b's products take the tensor-core kernel (K <= gemm_max_k, and its listed
    # down projection), llama-1b's qkv and o cuBLAS and its listed gate_up and down the tensor-core kernel.
    tuning = projections.TUNING
    assert tuning.gemv_max_m == tuning.gemv_max_m_tensor_core == 2
    for name, (n, k) in _decoder_products("small-0.6b").items():
        if name == "lm_head":  # large: the GEMV to 1 row, then cuBLAS
            continue
        assert projections.kernel_for(2, n, k, 2) is projections.Kernel.GEMV, name
        for rows in (3, 4):
            assert projections.kernel_for(rows, n, k, 2) is projections.Kernel.GEMM, (name, rows)
    for name, (n, k) in _decoder_products("llama-1b").items():
        past_gemv = projections.Kernel.GEMM if name in ("gate_up", "down") else projections.Kernel.CUBLAS
        small = n * k * 2 <= tuning.gemv_small_bytes  # qkv and o: the GEMV to 2 rows; the others to 1
        assert small == (name in ("qkv", "o")), name
        assert projections.kernel_for(2, n, k, 2) is (projections.Kernel.GEMV if small else past_gemv), name
        for rows in (3, 4):
            assert projections.kernel_for(rows, n, k, 2) is past_gemv, (name, rows)


def test_a_shape_measured_past_the_gemm_rows_takes_the_tensor_core_kernel_with_its_own_tile(
    op_target: OpTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An entry (rows up to, N, K, K tile, stages, K tiles a split keeps) routes its 2-byte product up to its rows (its
    # tile past gemm_max_m, its split at every row).
    own = ((32, 96, 256, 128, 4, 2),)
    tuning = dataclasses.replace(projections.TUNING, gemm_shape_tiles=own)
    monkeypatch.setattr(projections, "TUNING", tuning)
    assert projections.kernel_for(32, 96, 256, 2) is projections.Kernel.GEMM
    assert projections.kernel_for(20, 96, 256, 2) is projections.Kernel.GEMM
    assert projections.kernel_for(33, 96, 256, 2) is projections.Kernel.CUBLAS  # past its rows
    assert projections.kernel_for(32, 96, 256, 4) is projections.Kernel.CUBLAS  # measured for 2-byte weights
    assert projections.kernel_for(32, 97, 256, 2) is projections.Kernel.CUBLAS  # another shape
    plan = projections.gemm_plan(32, 48, 256, True, 2, INTERPRETER_SM_COUNT, tuning)  # paired: 2 x 48 rows
    assert (plan.block_k, plan.stages) == (128, 4)
    general = projections.gemm_plan(16, 48, 256, True, 2, INTERPRETER_SM_COUNT, tuning)  # gemm_max_m's own rows
    assert (general.block_k, general.stages) == (tuning.gemm_block_k, tuning.gemm_stages)
    assert general.k_per_split == 256  # its split at these rows too: 2 K tiles of 128 do not split
    unlisted = projections.gemm_plan(16, 48, 256, True, 2, INTERPRETER_SM_COUNT,
                                     dataclasses.replace(tuning, gemm_shape_tiles=(), gemm_min_k_tiles=1))
    assert unlisted.k_per_split < 256
    case = NormGateUpCase(BF16, 20, 48, 256)  # gate and up: 96 weight rows of K = 256
    assert_like_reference(op_target.ops, case, torch.device("cpu"),
                          "norm_gate_up_silu_mul on a measured tensor-core tile", op="norm_gate_up_silu_mul")


EPILOGUE_CASES = [
    ("linear_residual", LinearResidualCase(F32, 3, 48, 200)),
    ("norm_qkv_rope_kv_write", NormQkvCase(BF16, 3, 2, 64, 16, hidden=128, bias=True)),
    ("norm_gate_up_silu_mul", NormGateUpCase(BF16, 2, 96, 40)),
]


@pytest.mark.parametrize("early", [True, False], ids=["epilogue-loads-early", "epilogue-loads-late"])
@pytest.mark.parametrize(("op", "case"), EPILOGUE_CASES, ids=[op for op, _ in EPILOGUE_CASES])
def test_the_gemv_epilogue_reads_the_same_inputs_early_or_late(
    op_target: OpTarget, op: str, case: Case, early: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The residual, bias, cos/sin and slots may be read before the reduction: the same results either way.
    monkeypatch.setattr(projections, "TUNING", dataclasses.replace(  # the GEMV at every row of these cases
        projections.TUNING, gemv_early_epilogue_loads=early, gemv_max_m=4, gemv_max_m_tensor_core=4))
    assert_like_reference(op_target.ops, case, torch.device("cpu"),
                          f"{op} on the GEMV, epilogue loads {'early' if early else 'late'}", op=op)


class _SmallSharedMemory:
    """The tensor-core kernel on a GPU whose shared memory holds only the fallback tile: Triton refuses a larger
    one at its launch, as a GPU smaller than the one the tiles were measured on does."""

    def __init__(self, kernel: Any, fits: tuple[int, int]) -> None:
        self.kernel, self.fits = kernel, fits
        self.refused: list[tuple[int, int]] = []
        self.launched: list[tuple[int, int]] = []

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            tile = (kwargs["BLOCK_K"], kwargs["num_stages"])
            if tile[0] * tile[1] > self.fits[0] * self.fits[1]:
                self.refused.append(tile)
                raise triton.runtime.errors.OutOfResources(tile[0] * tile[1] * 1024, 232448, "shared memory")
            self.launched.append(tile)
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_a_tile_too_large_for_the_gpus_shared_memory_falls_back_to_the_small_tile_once(
    op_target: OpTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    tuning = dataclasses.replace(projections.TUNING, gemm_block_k=128, gemm_stages=5, gemm_fallback_tile=(64, 3))
    monkeypatch.setattr(projections, "TUNING", tuning)
    monkeypatch.setattr(projections, "_TOO_LARGE", set())
    small = _SmallSharedMemory(projection_kernels.gemm_kernel, tuning.gemm_fallback_tile)
    monkeypatch.setattr(projection_kernels, "gemm_kernel", small)
    case = NormGateUpCase(BF16, 8, 48, 256)  # 8 rows: the tensor-core kernel
    assert projections.kernel_for(8, 96, 256, 2) is projections.Kernel.GEMM
    expected = CALLS["norm_gate_up_silu_mul"](reference_ops(), case.build(0, torch.device("cpu")))
    for _ in range(2):
        actual = CALLS["norm_gate_up_silu_mul"](op_target.ops, case.build(0, torch.device("cpu")))
        for a, e in zip(actual, expected, strict=True):
            assert_matches(a, e, "norm_gate_up_silu_mul on the fallback tile")
    assert small.refused == [(128, 5)], "the large tile is tried once, then the product remembers it does not fit"
    assert small.launched == [(64, 3), (64, 3)]


def test_a_tile_refused_with_nothing_smaller_to_fall_back_to_is_the_error(
    op_target: OpTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    tuning = dataclasses.replace(projections.TUNING, gemm_block_k=64, gemm_stages=3, gemm_fallback_tile=(64, 3),
                                 gemm_shape_tiles=())
    monkeypatch.setattr(projections, "TUNING", tuning)
    monkeypatch.setattr(projections, "_TOO_LARGE", set())
    monkeypatch.setattr(projection_kernels, "gemm_kernel", _SmallSharedMemory(projection_kernels.gemm_kernel, (32, 2)))
    args = NormGateUpCase(BF16, 8, 48, 256).build(0, torch.device("cpu"))
    with pytest.raises(triton.runtime.errors.OutOfResources):
        CALLS["norm_gate_up_silu_mul"](op_target.ops, args)


def test_on_cublas_linear_residual_adds_into_the_residual_without_copying_it() -> None:
    # torch.addmm(residual, ...) copies the residual into a new output before the GEMM: a copy kernel per
    # projection of every step with prompt tokens. The op may write over the residual (the layer never reads it).
    x, weight = torch.randn(20, 64), torch.randn(48, 64)
    residual = torch.randn(20, 48)
    assert projections.kernel_for(20, 48, 64, 4) is projections.Kernel.CUBLAS
    expected = residual + x @ weight.t()
    out = projections.linear_residual(x, weight, residual)
    assert out.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(out, expected)
    strided = torch.randn(48, 20).t()  # not contiguous: added out of place
    out = projections.linear_residual(x, weight, strided)
    assert out.data_ptr() != strided.data_ptr()
    torch.testing.assert_close(out, strided + x @ weight.t())


FORCED_GEMM = [
    ("linear", LinearCase(BF16, 20, 97, 300, bias=True)),
    ("linear_residual", LinearResidualCase(F32, 33, 64, 200)),
    ("norm_gate_up_silu_mul", NormGateUpCase(BF16, 20, 96, 40)),
    ("norm_logits", NormLogitsCase(F32, 17, 64, 300)),
    ("norm_qkv_rope_kv_write", NormQkvCase(BF16, 20, 2, 64, 16, hidden=128, bias=True)),
    ("norm_gate_up_silu_mul", NormGateUpCase(BF16, 20, 1024, 24)),  # K split: the rows' squares summed over splits
]


@pytest.mark.parametrize(("swap", "paired_block_n", "stacked"), [(True, 64, False), (False, 64, False),
                                                                  (True, 32, False), (True, 64, True)],
                         ids=["weight-rows-as-mma-rows", "x-rows-as-mma-rows", "paired-halves-of-32-rows",
                              "paired-halves-stacked-in-one-tile"])
@pytest.mark.parametrize(("op", "case"), FORCED_GEMM, ids=[f"{op}-{i}" for i, (op, _) in enumerate(FORCED_GEMM)])
def test_the_tensor_core_kernel_matches_the_reference_where_it_is_chosen(
    op_target: OpTarget, op: str, case: Case, swap: bool, paired_block_n: int, stacked: bool,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    # Off by default (cuBLAS measured faster): chosen here for every M above the GEMV's, both tile orientations,
    # and paired products (SiLU's gate and up, RoPE's halves) in narrower tiles, or both halves in one tile.
    monkeypatch.setattr(projections, "TUNING", dataclasses.replace(
        projections.TUNING, gemm_max_m=1024, gemm_swap=swap, gemm_paired_block_n=paired_block_n,
        gemm_paired_stacked=stacked))
    assert projections.kernel_for(20, 97, 300, 2) is projections.Kernel.GEMM
    assert projections.gemm_plan(20, 97, 300, False, 2, INTERPRETER_SM_COUNT, projections.TUNING).swap is swap
    paired = projections.gemm_plan(20, 24, 1024, True, 2, INTERPRETER_SM_COUNT, projections.TUNING)
    assert paired.split_k > 1
    assert paired.stacked is stacked
    assert paired.block_n == (paired_block_n // (2 if stacked else 1) if swap
                              else projections.TUNING.gemm_block_n // 2)
    assert_like_reference(op_target.ops, case, torch.device("cpu"), f"{op} on the tensor-core kernel", op=op)


@pytest.mark.parametrize(("op", "case"), DESCRIPTOR_GEMM, ids=DESCRIPTOR_GEMM_IDS)
def test_weight_tiles_through_a_descriptor_give_the_reference_results(
    op_target: OpTarget, op: str, case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Off by default (no faster in the step); tests/backends/test_triton_descriptors.py runs these on a GPU
    assert_weights_through_descriptors(op_target.ops, op, case, op_target.torch_device, monkeypatch)


def test_the_descriptor_cases_take_split_and_unsplit_products() -> None:
    tuning = dataclasses.replace(projections.TUNING, gemm_max_m=1024, gemm_tma=True)
    splits = {projections.gemm_plan(20, 2 * 24, 1024, True, 2, INTERPRETER_SM_COUNT, tuning).split_k,
              projections.gemm_plan(20, 97, 256, False, 2, INTERPRETER_SM_COUNT, tuning).split_k}
    assert 1 in splits and max(splits) > 1


@pytest.mark.parametrize("splits", every(2, [2, 4]))
def test_a_captured_step_split_over_its_keys_matches_the_reference(op_target: OpTarget, splits: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Each query block's keys shared among programs, merged by their log-sum-exp: forced here on the captured
    # steps whose rows reach past one key tile (contexts of 1,500 and 700 tokens), padding tokens included.
    chosen = attention.captured_config
    monkeypatch.setattr(attention, "captured_config", lambda *shape: chosen(*shape)._replace(splits=splits))
    seed = splits // 4  # each case's first step in two splits, its second in four (the interpreter is slow)
    for case in CAPTURED_CASES[2:]:
        assert_like_reference(op_target.ops, case, torch.device("cpu"),
                              f"a captured step in {splits} key splits, step {seed}", op="paged_attention", seed=seed)


def test_the_sampler_processes_logits_as_the_reference_bit_for_bit() -> None:
    # The draw and the argmax compare tokens; this compares what they are taken from: bias, bans and the penalties
    # (rows with every penalty neutral are left as they are, without reading their counts).
    from corelib_cuda.triton_ops.sampling import processed_logits

    from corelib.ops import SamplingInputs
    from corelib.ops.sampling import processed_logits as reference
    from corelib.testing.op_cases import SampleCase

    for seed in range(3):
        logits, sampling = SampleCase(16, 1000, sampled=True).build(seed, torch.device("cpu"))
        assert isinstance(logits, torch.Tensor) and isinstance(sampling, SamplingInputs)
        assert torch.equal(processed_logits(logits, sampling), reference(logits, sampling)), seed


def test_a_row_holding_nan_still_samples_a_valid_token_id() -> None:
    # The finite check fails such a request, but its id may already feed the next step's embedding lookup.
    from corelib_cuda.triton_ops.sampling import sample

    from corelib.ops import SamplingInputs

    logits = torch.randn(3, 5000)
    logits[1, 7] = float("nan")
    logits[2] = float("nan")
    drawn = SamplingInputs.of(torch.arange(3), seeds=[1, 2, 3], temperature=[0.0, 1.0, 1.0])
    for sampling in (None, drawn):
        tokens = sample(logits, sampling)
        assert bool(((tokens >= 0) & (tokens < 5000)).all()), tokens
