"""Tensor parallelism: ranks in worker processes, weights sharded Megatron-style, inputs broadcast over SHM."""

from __future__ import annotations

import os
import select
import signal
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from ringkit import RecordingPoller

from corelib.config.schema import ModelConfig
from corelib.engine import Engine, SamplingParams
from corelib.errors import ConfigError, CorelibError, WorkerDied
from corelib.models.random_init import random_state_dict
from corelib.models.registry import model_shape
from corelib.models.sharding import TensorShard
from corelib.models.weight_map import weight_map
from corelib.transport import doorbell
from corelib.transport.shm import PREFIX, SHM_DIR
from corelib.transport.shm_executor import ShmExecutor

PROMPTS = [[5, 6, 7], list(range(10, 40)), [100] * 5, [3, 4]]
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 33, 1, 40)]


def tokens(overrides: list[str]) -> list[list[int]]:
    with Engine.from_overrides(overrides) as engine:
        return [o.output_token_ids for o in engine.generate(PROMPTS, PARAMS)]


def our_segments() -> set[str]:
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(f"{PREFIX}-{os.getpid()}-")}


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(["backend=cpu"], id="cpu-gloo"),
        pytest.param(["backend=npu", "backend.emulator.chaos=0.3"], id="npu-emulated-gloo",
                     marks=pytest.mark.long),  # a second rank pair over gloo: with the long checks
        pytest.param(["backend=cuda", "backend.runtime=native"], id="cuda-nccl", marks=[
            pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]),
        pytest.param(["backend=cuda", "backend.runtime=native", "engine.async_token_handoff=on"],
                     id="cuda-nccl-async", marks=[
            pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]),
    ],
)
def test_tp2_gives_the_tokens_of_tp1(backend: list[str]) -> None:
    before = our_segments()
    single = tokens([*backend])
    assert tokens([*backend, "engine.transport=shm", "engine.tp=2"]) == single
    assert our_segments() == before


SAMPLED = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=t, top_k=k, top_p=p, seed=seed)
           for n, t, k, p, seed in ((20, 0.0, 0, 1.0, 0), (24, 0.8, 0, 0.9, 3), (6, 1.0, 8, 1.0, 5),
                                    (30, 0.7, 0, 1.0, 9))]


@pytest.mark.slow
@pytest.mark.long  # two ranks per case, each a process importing torch
@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(["backend=cpu"], id="cpu-gloo"),
        pytest.param(["backend=npu", "backend.emulator.chaos=0.3", "engine.async_token_handoff=on"],
                     id="npu-emulated-gloo-async"),
    ],
)
def test_the_vocabulary_parallel_head_gives_tp1s_tokens_sampled_and_for_an_odd_vocabulary(
    backend: list[str],
) -> None:
    # 509 tokens over 2 ranks: the second block is padded, and its padding must never be picked.
    # Greedy batches pick through the small all-reduce; a batch with a sampled request gathers the
    # whole logits across ranks and samples them as tp=1 does.
    common = [*backend, "model.vocab_size=509"]

    def run(overrides: list[str]) -> list[list[int]]:
        with Engine.from_overrides(overrides) as engine:
            greedy = [o.output_token_ids for o in engine.generate(PROMPTS, PARAMS)]
            return greedy + [o.output_token_ids for o in engine.generate(PROMPTS, SAMPLED)]

    single = run(common)
    assert run([*common, "engine.transport=shm", "engine.tp=2"]) == single


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused-qkv-gate-up"])
def test_shards_put_back_together_are_the_full_weights(fused: bool) -> None:
    shape = replace(model_shape(ModelConfig(name="t")), fused_qkv=fused, fused_gate_up=fused)
    full = random_state_dict(shape, 0)
    sources = weight_map(shape).sources
    shards = [TensorShard(rank, 2) for rank in range(2)]
    local_shapes = weight_map(shards[0].shape(shape)).shapes()
    for name, tensor in full.items():
        parts = [s.slice(sources[name], tensor) for s in shards]
        assert tuple(parts[0].shape) == local_shapes[name], name
        if parts[0].shape == tensor.shape:
            assert all(torch.equal(p, tensor) for p in parts), f"{name} should be replicated"
        elif parts[0].shape[0] == tensor.shape[0]:
            assert torch.equal(torch.cat(parts, dim=1), tensor), name  # row-parallel: input columns
        else:  # column-parallel: each stacked part (q, k, v of a fused qkv_proj) split on its own
            stacked = sources[name].parts or (tensor.shape[0],)
            halves = [torch.split(p, [rows // 2 for rows in stacked]) for p in parts]
            whole = [torch.cat(pieces) for pieces in zip(*halves, strict=True)]
            assert torch.equal(torch.cat(whole), tensor), name


def rows(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def test_a_fused_tensors_shards_hold_each_ranks_heads_of_every_part() -> None:
    # tiny: 4 query heads and 2 key/value heads of 32, 384 gate and 384 up features; 2 ranks. Each row
    # of a fused tensor holds its own index, so a shard's rows say which rows of the checkpoint it took.
    shape = replace(model_shape(ModelConfig(name="t")), fused_qkv=True, fused_gate_up=True, attention_bias=True)
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate_size) == (4, 2, 32, 384)
    q, kv = 4 * 32, 2 * 32
    expected = {
        "model.layers.0.self_attn.qkv_proj.weight": [
            rows(0, 64) + rows(q, 32) + rows(q + kv, 32),  # q heads 0-1, k head 0, v head 0
            rows(64, 64) + rows(q + 32, 32) + rows(q + kv + 32, 32),  # q heads 2-3, k head 1, v head 1
        ],
        "model.layers.0.self_attn.qkv_proj.bias": [
            rows(0, 64) + rows(q, 32) + rows(q + kv, 32),
            rows(64, 64) + rows(q + 32, 32) + rows(q + kv + 32, 32),
        ],
        "model.layers.0.mlp.gate_up_proj.weight": [
            rows(0, 192) + rows(384, 192),  # the first half of the gate features, then of the up ones
            rows(192, 192) + rows(576, 192),
        ],
    }
    sources = weight_map(shape).sources
    for name, per_rank in expected.items():
        source = sources[name]
        numbered = torch.arange(source.shape[0], dtype=torch.float32)
        tensor = numbered if len(source.shape) == 1 else numbered[:, None].expand(source.shape).contiguous()
        for rank, want in enumerate(per_rank):
            shard = TensorShard(rank, 2).slice(source, tensor)
            taken = shard if shard.dim() == 1 else shard[:, 0]
            assert taken.tolist() == want, f"{name}, rank {rank}"
            assert shard.dim() == 1 or torch.equal(shard, tensor[want]), f"{name}, rank {rank}: whole rows"


def test_tp_needs_the_shm_transport_and_divisible_sizes() -> None:
    with pytest.raises(ConfigError, match=r"add engine\.transport=shm"):
        Engine.from_overrides(["backend=cpu", "engine.tp=2"])
    with pytest.raises(ConfigError, match=r"engine.tp=3 must divide model.num_heads=4, model.num_kv_heads=2"):
        Engine.from_overrides(["backend=cpu", "engine.transport=shm", "engine.tp=3"])


TWO_GPUS = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
BACKENDS = [
    pytest.param(["backend=cpu"], id="cpu-gloo"),
    pytest.param(["backend=cuda", "backend.runtime=native"], id="cuda-nccl", marks=TWO_GPUS),
]


def recorded_waits(monkeypatch: pytest.MonkeyPatch) -> list[RecordingPoller]:
    """Every poll of the transport's waits from now on, with no periodic check in between:
    a poll that returned nothing is a wait that ran out (see ringkit.RecordingPoller)."""
    monkeypatch.setattr(doorbell, "CHECK_S", 3600.0)
    pollers: list[RecordingPoller] = []
    plain_poll = select.poll

    def recording_poll() -> RecordingPoller:
        pollers.append(RecordingPoller(plain_poll()))
        return pollers[-1]

    monkeypatch.setattr(select, "poll", recording_poll)  # the module the waiters call
    return pollers


def ran_out(pollers: list[RecordingPoller]) -> int:
    return sum(1 for poller in pollers for events in poller.returned if not events)


def counted_timeouts(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The timeout of every transport wait from now on that ran out."""
    timeouts: list[float] = []
    wait = doorbell.Waiter.wait

    def counted(self: doorbell.Waiter, ready: Callable[[], bool], timeout: float) -> bool:
        done = wait(self, ready, timeout)
        if not done:
            timeouts.append(timeout)
        return done

    monkeypatch.setattr(doorbell.Waiter, "wait", counted)
    return timeouts


def _start_tp(backend: list[str], timeout: float) -> tuple[Engine, ShmExecutor]:
    engine = Engine.from_overrides([*backend, "engine.transport=shm", "engine.tp=2", f"engine.timeout_s={timeout}"])
    executor = engine.core.executor
    assert isinstance(executor, ShmExecutor)
    for i in range(4):
        engine.add_request([i + 2, i + 3], SamplingParams(max_tokens=1000, ignore_eos=True))
    for _ in range(4):
        engine.step()
    return engine, executor


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_killing_one_rank_is_a_clean_error_within_the_timeout(
    backend: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = our_segments()
    pollers = recorded_waits(monkeypatch)
    engine, executor = _start_tp(backend, timeout=10.0)
    victim = executor.ranks[1].process.pid
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(WorkerDied, match=rf"worker rank 1 \(pid {victim}\) was killed by SIGKILL"):
        while engine.has_unfinished:
            engine.step()
    assert pollers and ran_out(pollers) == 0, "a wait ran out before the killed rank was noticed"
    engine.close()
    assert all(rank.process.poll() is not None for rank in executor.ranks)
    assert our_segments() == before


@pytest.mark.slow
@pytest.mark.long  # waits out a collective's timeout
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stalled_rank_stops_the_engine_naming_it(backend: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    timeouts = counted_timeouts(monkeypatch)
    engine, executor = _start_tp(backend, timeout=2.0)
    stalled = executor.ranks[1].process.pid
    os.kill(stalled, signal.SIGSTOP)
    try:
        with pytest.raises(CorelibError) as caught:
            while engine.has_unfinished:
                engine.step()
        # Rank 0's collective and the scheduler's wait both give up after engine.timeout_s; whichever
        # is first stops the engine: no wait is started after one ran out.
        assert len(timeouts) <= 1, f"the engine kept waiting after a wait ran out: {timeouts}"
        message = str(caught.value)
        assert "step" in message and "worker rank 1" in message, message
    finally:
        engine.close()  # SIGKILL reaches a stopped process
    assert all(rank.process.poll() is not None for rank in executor.ranks)


@pytest.mark.slow
@pytest.mark.long  # a torchrun launcher and its rank
def test_torchrun_launches_one_process_and_its_rendezvous_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    from corelib.transport.parallel import rendezvous

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"torchrun --nproc-per-node=1"):
        Engine.from_overrides(["backend=cpu", "engine.transport=shm", "engine.tp=2"])
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29533")
    assert rendezvous() == ("127.0.0.1", 29533)
    assert tokens(["backend=cpu", "engine.transport=shm", "engine.tp=2"]) == tokens(["backend=cpu"])
