"""The memory check at start: what the machine can hold, and which devices it applies to."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from corelib.config.schema import CorelibConfig
from corelib.errors import ConfigError
from corelib.platform.backend import DeviceSpec
from corelib.platform.device import Capabilities, Runtime
from corelib.startup import limits
from corelib.startup.compose import compose_config

GIB = 2**30


def config(*overrides: str) -> CorelibConfig:
    typed = OmegaConf.to_object(compose_config(["backend=cpu", *overrides]))
    assert isinstance(typed, CorelibConfig)
    return typed


def fake_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, available_gib: int, cgroup_gib: int | None) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_gib * 2**20} kB\n")
    monkeypatch.setattr(limits, "MEMINFO", meminfo)
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    if cgroup_gib is not None:
        (cgroup / "memory.max").write_text(f"{cgroup_gib * GIB}\n")
        (cgroup / "memory.current").write_text(f"{GIB}\n")
    monkeypatch.setattr(limits, "CGROUP", cgroup)


def test_a_container_limit_below_the_host_memory_is_what_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "limited").mkdir()
    fake_machine(tmp_path / "limited", monkeypatch, available_gib=64, cgroup_gib=4)
    assert limits.available_host_bytes() == 3 * GIB
    (tmp_path / "no-limit").mkdir()
    fake_machine(tmp_path / "no-limit", monkeypatch, available_gib=64, cgroup_gib=None)
    assert limits.available_host_bytes() == 64 * GIB


def test_the_kv_estimate_is_what_the_runner_allocates() -> None:
    total, per_block, blocks = limits.kv_cache_bytes(config("engine.num_kv_blocks=10", "engine.block_size=16"))
    # tiny: 2 layers, K and V, 16 tokens, 2 KV heads of 32, float32
    assert (per_block, blocks, total) == (2 * 2 * 16 * 2 * 32 * 4, 10, 10 * per_block)


def test_a_pool_beyond_host_memory_is_refused_where_the_device_is_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_machine(tmp_path, monkeypatch, available_gib=1, cgroup_gib=None)
    cfg = config("engine.num_kv_blocks=100000")  # 100000 blocks of 16 KiB: 1.5 GiB
    emulated = DeviceSpec("npu", Runtime.emulated, Capabilities())
    host = DeviceSpec("cpu", Runtime.native, Capabilities(device_is_host=True))
    for spec in (emulated, host):
        with pytest.raises(ConfigError, match=r"num_kv_blocks=100000: the KV cache needs 1\.5 GiB .* but 1\.0 GiB"):
            limits.check_memory(cfg, spec)
    limits.check_memory(cfg, DeviceSpec("cuda", Runtime.native, Capabilities()))  # the device's own memory: its call
    limits.check_memory(config("engine.num_kv_blocks=1000"), emulated)


def test_llama_8b_over_two_native_gpus_is_not_refused_for_the_host_memory_it_never_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_machine(tmp_path, monkeypatch, available_gib=8, cgroup_gib=None)  # less than the 15 GiB of weights
    cfg = config("model=llama-8b", "engine.transport=shm", "engine.tp=2")
    assert limits.weight_bytes(cfg) == 8_030_261_248 * 2
    limits.check_memory(cfg, DeviceSpec("cuda", Runtime.native, Capabilities(symmetric_memory=True)))
    with pytest.raises(ConfigError, match=r"the weights need 15\.0 GiB .* but 8\.0 GiB of host memory"):
        limits.check_memory(config("model=llama-8b", "engine.num_kv_blocks=8"),
                            DeviceSpec("cuda", Runtime.emulated, Capabilities()))
