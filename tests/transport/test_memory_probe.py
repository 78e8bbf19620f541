"""Over SHM on an accelerator the pool is sized from the device's memory, read by a short-lived probe process
before the workers start (the scheduler's process never opens the device)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
import torch

from corelib.config.options import EngineOptions
from corelib.config.schema import CorelibConfig, EngineConfig, ModelConfig
from corelib.engine.api import Engine
from corelib.models.synthetic import tiny_hf_config, write_random_checkpoint
from corelib.plugins import PluginRegistry
from corelib.sampling_params import SamplingParams
from corelib.startup.compose import compose_config, prepare_config_store
from corelib.startup.kv_pool import (
    RUNTIME_HEADROOM,
    block_bytes,
    estimate_activations,
    memory_figures,
    profile_tokens,
    size_pool,
)
from corelib.startup.limits import weight_bytes
from corelib.startup.start import Startup, start
from corelib.transport.memory_probe import probe_memory

GIB = 1 << 30


def _start(*overrides: str) -> Startup:
    registry = PluginRegistry()
    prepare_config_store(registry)
    return start(compose_config(list(overrides)), registry)


def test_probed_memory_fills_the_share_after_the_weights_the_workers_will_load() -> None:
    model = ModelConfig(name="unit", num_layers=2, num_kv_heads=2, hidden_size=128, num_heads=4,
                        max_model_len=1 << 20, dtype="bfloat16")
    config = CorelibConfig(engine=EngineConfig(tp=2), model=model)
    options = cast(EngineOptions, SimpleNamespace(chunked_prefill=True, graphs=True))
    figures = memory_figures(config, options, host=False, device=None, model=None, probed=(6 * GIB, 8 * GIB))
    assert figures is not None and not figures.measured
    weights = weight_bytes(config) // 2  # this rank's share
    assert (figures.used, figures.free) == (weights, 6 * GIB - RUNTIME_HEADROOM - weights)
    activations = estimate_activations(config, profile_tokens(config, True))
    assert figures.activations == activations and figures.graphs >= 64 << 20
    pool = size_pool(config, figures, default_context=True)
    budget = min(int(0.9 * 8 * GIB) - weights, 6 * GIB - RUNTIME_HEADROOM - weights) - activations - figures.graphs
    assert pool.num_blocks == budget // block_bytes(config)
    assert "device memory" in pool.lines[0] and "(only" in pool.lines[0], "the free memory bounds it"
    assert memory_figures(config, options, host=False, device=None, model=None) is None, "nothing read: no figures"


@pytest.mark.slow
@pytest.mark.long  # two interpreters importing torch
def test_the_probe_reads_each_ranks_device_and_says_why_when_it_cannot() -> None:
    startup = _start("backend=npu", "model=tiny")
    answer = probe_memory(startup.spec, 2, timeout_s=120)
    assert answer.reason is None and answer.info is not None
    free, total = answer.info
    assert 0 < free <= total, "the emulator reports the host's memory"
    missing = probe_memory(dataclasses.replace(startup.spec, backend="no-such-backend"), 1, timeout_s=120)
    assert missing.info is None and missing.reason is not None
    assert missing.reason.startswith("the memory probe exited with code 1: ") and "no-such-backend" in missing.reason




@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_shm_on_the_gpu_sizes_the_pool_from_the_devices_memory(tmp_path: Path) -> None:
    # A checkpoint of a long context: sized by what 64 requests of it need, the pool would not fit the device.
    # KV blocks of 1 MiB (32 layers of 8 KV heads of 64): 64 requests of 2**20 tokens need some 4 TiB.
    config = tiny_hf_config(torch_dtype="bfloat16", max_position_embeddings=1 << 20, num_hidden_layers=32,
                            num_attention_heads=8, num_key_value_heads=8, hidden_size=512)
    write_random_checkpoint(tmp_path, config, dtype=torch.bfloat16)
    # A share well under what the suite's other processes leave free, so the share binds, not their usage.
    started = _start("backend=cuda", f"model.path={tmp_path}", "engine.transport=shm", "engine.max_num_seqs=64",
                     "engine.gpu_memory_utilization=0.3")
    engine = Engine(started)
    try:
        [line] = [n for n in engine.notices if n.startswith("KV pool:")]
        assert "engine.gpu_memory_utilization=0.3 of" in line and "device memory" in line and "estimated" in line
        total = torch.cuda.mem_get_info()[1]
        assert 0.2 * total < engine.layout.num_blocks * block_bytes(started.config) < 0.3 * total
        [out] = engine.generate([[3, 4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out.output_token_ids) == 4
    finally:
        engine.close()
