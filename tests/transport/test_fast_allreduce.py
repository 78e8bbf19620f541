"""The tensor-parallel all-reduce: which path each message takes, and the collective wherever symmetric memory is not.

The symmetric-memory kernels need GPUs; here a stand-in for ``torch.ops.symm_mem`` records what
the all-reduce asks of it, and two gloo ranks show the fallbacks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from groupkit import run_two_ranks

from corelib.config.options import EngineOptions
from corelib.plugins import PluginRegistry
from corelib.startup.compose import compose_config
from corelib.startup.start import start
from corelib.transport.parallel import (
    ONE_SHOT_MAX_BYTES,
    SYMMETRIC_BUFFER_BYTES,
    Route,
    SymmetricAllReduce,
    route,
)
from corelib.trust.isolation import NO_MULTICAST, worker_environment

HIDDEN = 4096


class FakeSymmOps:
    """``torch.ops.symm_mem`` (before torch 2.8: no copy-in variant) for two ranks holding equal tensors.

    Every sum doubles. It checks what the real ops check (the kernel gets the symmetric buffer,
    viewed with the output's shape) and records each call, so a test sees which kernel ran.
    """

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def _in_buffer(self, view: torch.Tensor) -> None:
        start, end = self.buffer.data_ptr(), self.buffer.data_ptr() + self.buffer.numel()
        assert start <= view.data_ptr() < end, "the kernel must be given the symmetric buffer"

    def one_shot_all_reduce_out(self, symm: torch.Tensor, op: str, group: str, out: torch.Tensor) -> torch.Tensor:
        self._in_buffer(symm)
        assert symm.shape == out.shape and op == "sum"
        self.calls.append(("one_shot", tuple(out.shape)))
        return out.copy_(symm * 2)

    def two_shot_all_reduce_(self, symm: torch.Tensor, op: str, group: str) -> torch.Tensor:
        self._in_buffer(symm)
        self.calls.append(("two_shot", tuple(symm.shape)))
        return symm.mul_(2)


class FakeSymmOpsWithCopyIn(FakeSymmOps):
    """torch 2.8 and later: the one-shot kernel copies the local tensor in itself."""

    def one_shot_all_reduce_copy_out(self, symm: torch.Tensor, local: torch.Tensor, op: str, group: str,
                                     out: torch.Tensor) -> torch.Tensor:
        self._in_buffer(symm)
        assert symm.shape == out.shape and op == "sum"
        symm.copy_(local)
        self.calls.append(("one_shot_copy", tuple(out.shape)))
        return out.copy_(symm * 2)


class Collective:
    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(tensor.shape))
        return tensor.mul_(2)


def _all_reduce(copy_in_kernel: bool = True) -> tuple[SymmetricAllReduce, FakeSymmOps, Collective]:
    buffer = torch.zeros(SYMMETRIC_BUFFER_BYTES, dtype=torch.uint8)
    ops = FakeSymmOpsWithCopyIn(buffer) if copy_in_kernel else FakeSymmOps(buffer)
    collective = Collective()
    return SymmetricAllReduce(buffer, "0", collective, ops), ops, collective


@pytest.mark.parametrize(
    ("shape", "dtype", "expected"),
    [
        ((1, HIDDEN), torch.bfloat16, Route.one_shot),  # a decode step at batch 1: 8 KiB
        ((32, HIDDEN), torch.bfloat16, Route.one_shot),  # batch 32: 256 KiB
        ((64, HIDDEN), torch.bfloat16, Route.one_shot),  # 512 KiB, the one-shot limit
        ((65, HIDDEN), torch.bfloat16, Route.two_shot),  # a short prefill
        ((1024, HIDDEN), torch.bfloat16, Route.two_shot),  # 8 MiB: the whole buffer
        ((1025, HIDDEN), torch.bfloat16, Route.collective),  # beyond the buffer
        ((1, HIDDEN), torch.float32, Route.one_shot),
        ((1, HIDDEN), torch.float16, Route.collective),  # the kernels sum bfloat16 and float32 only
        ((1, 3), torch.bfloat16, Route.collective),  # 6 bytes: not a multiple of 4
        ((0, HIDDEN), torch.bfloat16, Route.collective),
    ],
)
def test_each_message_takes_the_route_its_size_and_dtype_allow(
    shape: tuple[int, ...], dtype: torch.dtype, expected: Route
) -> None:
    assert route(torch.empty(shape, dtype=dtype)) is expected


def test_a_strided_view_goes_to_the_collective() -> None:
    assert route(torch.empty(HIDDEN, 2, dtype=torch.bfloat16).t()) is Route.collective


def test_the_one_shot_limit_fits_a_decode_step_of_64_sequences_at_hidden_4096() -> None:
    assert ONE_SHOT_MAX_BYTES >= 64 * HIDDEN * 2


@pytest.mark.parametrize("copy_in_kernel", [True, False], ids=["copy-in-kernel", "copy-then-kernel"])
def test_a_decode_sized_all_reduce_is_one_symmetric_kernel_in_place(copy_in_kernel: bool) -> None:
    all_reduce, ops, collective = _all_reduce(copy_in_kernel)
    x = torch.randn(8, HIDDEN, dtype=torch.bfloat16)
    expected = x * 2
    out = all_reduce(x)
    assert out is x, "the row-parallel layers rely on an in-place sum"
    assert torch.equal(x, expected)
    assert [name for name, _ in ops.calls] == (["one_shot_copy"] if copy_in_kernel else ["one_shot"])
    assert ops.calls[0][1] == (8, HIDDEN)
    assert collective.shapes == []


def test_a_view_that_does_not_start_its_storage_is_copied_in_first() -> None:
    all_reduce, ops, _ = _all_reduce()
    storage = torch.randn(3, HIDDEN, dtype=torch.bfloat16)
    x = storage[1:]  # offset: the copy-in kernel would see it misaligned with the buffer
    expected = x * 2
    all_reduce(x)
    assert torch.equal(x, expected)
    assert [name for name, _ in ops.calls] == ["one_shot"]


def test_a_prefill_sized_all_reduce_is_two_shot_and_copied_back() -> None:
    all_reduce, ops, collective = _all_reduce()
    x = torch.randn(512, HIDDEN, dtype=torch.bfloat16)
    expected = x * 2
    assert all_reduce(x) is x
    assert torch.equal(x, expected)
    assert ops.calls == [("two_shot", (512, HIDDEN))]
    assert collective.shapes == []


def test_messages_beyond_the_buffer_or_in_float16_use_the_collective() -> None:
    all_reduce, ops, collective = _all_reduce()
    big = torch.randn(2048, HIDDEN, dtype=torch.bfloat16)
    half = torch.randn(4, HIDDEN, dtype=torch.float16)
    expected = (big * 2, half * 2)
    all_reduce(big)
    all_reduce(half)
    assert (torch.equal(big, expected[0]), torch.equal(half, expected[1])) == (True, True)
    assert collective.shapes == [(2048, HIDDEN), (4, HIDDEN)]
    assert ops.calls == []
    assert all_reduce.calls == {Route.one_shot: 0, Route.two_shot: 0, Route.collective: 2}


def test_the_symmetric_buffer_must_be_bytes() -> None:
    with pytest.raises(ValueError, match="1-D uint8"):
        SymmetricAllReduce(torch.zeros(16, dtype=torch.bfloat16), "0", Collective(), object())


@pytest.fixture(scope="module")
def two_ranks_one_failing() -> dict[int, dict[str, Any]]:
    return run_two_ranks(failing_rank=1)


@pytest.fixture(scope="module")
def two_ranks_both_ready() -> dict[int, dict[str, Any]]:
    return run_two_ranks(failing_rank=-1)


@pytest.mark.slow
def test_over_gloo_init_group_keeps_the_collective_and_sums(two_ranks_one_failing: dict[int, dict[str, Any]]) -> None:
    for rank in (0, 1):
        assert two_ranks_one_failing[rank]["init_group_sum"] == [[3.0] * 4] * 3
        assert two_ranks_one_failing[rank]["init_group_stderr"] == "", "host memory has no peers to try mapping"


@pytest.mark.slow
def test_a_rank_that_cannot_set_up_symmetric_memory_takes_every_rank_to_the_collective(
    two_ranks_one_failing: dict[int, dict[str, Any]],
) -> None:
    for rank in (0, 1):
        assert two_ranks_one_failing[rank]["chosen"] == "function", "rank 0 must not wait on a path rank 1 lacks"
        assert two_ranks_one_failing[rank]["routed"] == [3.0, 3.0]


@pytest.mark.slow
def test_ranks_that_all_set_up_symmetric_memory_use_it(two_ranks_both_ready: dict[int, dict[str, Any]]) -> None:
    for rank in (0, 1):
        assert two_ranks_both_ready[rank]["chosen"] == "Doubling"
        assert two_ranks_both_ready[rank]["routed"] == [2.0 * (rank + 1)] * 2


@pytest.mark.slow
def test_init_group_switches_multicast_off(two_ranks_one_failing: dict[int, dict[str, Any]]) -> None:
    assert two_ranks_one_failing[0]["environment"] == NO_MULTICAST


def test_a_worker_starts_with_multicast_off_whatever_the_environment_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    env = worker_environment()
    assert {name: env[name] for name in NO_MULTICAST} == NO_MULTICAST


def _options(overrides: list[str]) -> EngineOptions:
    return start(compose_config(overrides), PluginRegistry()).options


def test_the_options_carry_the_gate_decision() -> None:
    tp2 = ["backend=cpu", "engine.transport=shm", "engine.tp=2"]
    assert not _options(tp2).fast_allreduce, "the cpu profile has no symmetric memory"
    claimed = [*tp2, "backend.capabilities.symmetric_memory=true", "engine.fast_allreduce=on"]
    assert _options(claimed).fast_allreduce
    assert not _options([*claimed[:-1], "engine.fast_allreduce=off"]).fast_allreduce


def test_the_emulator_never_has_symmetric_memory_and_the_plan_says_why() -> None:
    startup = start(compose_config(["backend=cuda", "backend.runtime=emulated", "engine.transport=shm",
                                    "engine.tp=2"]), PluginRegistry())
    assert startup.spec.capabilities.symmetric_memory is False
    decision = startup.plan.decisions["fast_allreduce"]
    assert not decision.enabled
    assert any("capabilities.symmetric_memory is false" in reason for reason in decision.reasons)


def test_the_cuda_probe_narrows_symmetric_memory_where_torch_lacks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from corelib_cuda.backend import CUDABackend, symmetric_memory_missing

    class Hopper:  # torch.cuda as far as the narrowing reads it
        def get_device_capability(self, index: int) -> tuple[int, int]:
            return (9, 0)

    monkeypatch.setattr(torch.version, "cuda", None)
    assert symmetric_memory_missing() == "torch is not a CUDA build"
    assert CUDABackend()._narrow(Hopper()).get("symmetric_memory") is False
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert symmetric_memory_missing() is None, "this torch has the ops, only not their CUDA kernels"
    assert "symmetric_memory" not in CUDABackend()._narrow(Hopper())

    class OldOps:
        one_shot_all_reduce_out = object()

    monkeypatch.setattr(torch.ops, "symm_mem", OldOps())
    assert symmetric_memory_missing() == f"torch {torch.__version__} lacks torch.ops.symm_mem.two_shot_all_reduce_"
    assert CUDABackend()._narrow(Hopper()).get("symmetric_memory") is False


@pytest.mark.parametrize(("dtype", "enabled"), [("bfloat16", True), ("float32", True), ("float16", False)])
def test_the_gate_enables_symmetric_memory_only_for_the_dtypes_its_kernels_sum(dtype: str, enabled: bool) -> None:
    from omegaconf import OmegaConf

    from corelib.config.features import evaluate
    from corelib.models import model_facts

    cfg = compose_config(["backend=npu", "engine.transport=shm", "engine.tp=2", f"model.dtype={dtype}"])
    capabilities = {**OmegaConf.to_container(cfg.backend.capabilities), "symmetric_memory": True}  # type: ignore[dict-item]
    typed = OmegaConf.to_object(cfg)
    plan = evaluate(cfg.features, cfg, capabilities, model_facts(typed.model))  # type: ignore[union-attr]
    decision = plan.decisions["fast_allreduce"]
    assert decision.enabled is enabled, decision.reasons
    if not enabled:
        assert decision.reasons == ("the symmetric-memory kernels sum bfloat16 and float32 only (model.dtype)",)
