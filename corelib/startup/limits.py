"""Sizes and values that cannot work, refused at startup with one line naming the key.

Without these checks a zero or negative size surfaced deep inside as a ZeroDivisionError or
a tensor with a negative dimension (exit 1), a NaN norm epsilon or a negative RoPE base ran
to the end and produced token 0 everywhere (exit 0), and a KV pool larger than the machine
failed with a MemoryError after a long wait.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from corelib.config.schema import CorelibConfig
from corelib.errors import ConfigError
from corelib.models.hf_config import NO_EOS
from corelib.models.registry import LlamaVariant, architecture
from corelib.models.rope import RopeScaling, inv_freq
from corelib.models.weight_map import weight_map
from corelib.platform.backend import DeviceSpec
from corelib.step.buckets import blocks_for

RUN_AHEAD = (1, 2)  # engine.run_ahead's values: one step ahead hides the host's work, a second one more
MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


def check_limits(config: CorelibConfig) -> None:
    """Refuse sizes and limits that cannot work, naming the key, before anything is built from them."""
    engine, model = config.engine, config.model
    least = {
        "engine.max_num_seqs": (engine.max_num_seqs, 1),
        "engine.block_size": (engine.block_size, 1),
        "engine.max_num_batched_tokens": (engine.max_num_batched_tokens, 1),
        "engine.num_kv_blocks": (engine.num_kv_blocks, 0),  # 0: sized for max_num_seqs full requests
        "engine.shm.num_slots": (engine.shm.num_slots, 1),
        "engine.metrics_window": (engine.metrics_window, 1),
        "model.max_model_len": (model.max_model_len, 2),  # a prompt token and room for one output
        "model.vocab_size": (model.vocab_size, 2),
        "model.hidden_size": (model.hidden_size, 1),
        "model.num_layers": (model.num_layers, 1),
        "model.num_heads": (model.num_heads, 1),
        "model.num_kv_heads": (model.num_kv_heads, 1),
        "model.head_dim": (model.head_dim, 0),  # 0: hidden_size // num_heads
        "model.intermediate_size": (model.intermediate_size, 1),
    }
    variant = architecture(model.architecture)
    if isinstance(variant, LlamaVariant) and variant.conv_state:
        least["model.conv_kernel"] = (model.conv_kernel, 1)
    for key, (value, low) in least.items():
        if value < low:
            raise ConfigError(f"{key}={value}: must be at least {low}")
    if engine.run_ahead is not None and engine.run_ahead not in RUN_AHEAD:
        # Each step in flight gets a host arena and a token handoff slot, built at start: a large value
        # only builds those (10**6 took over a minute) and a negative one leaves the pipeline no depth.
        raise ConfigError(f"engine.run_ahead={engine.run_ahead}: must be 1 or 2 (steps the scheduler submits "
                          "beyond the one it reads, with async handoff)")
    if not 0 < engine.gpu_memory_utilization <= 1:  # a share of the device's memory (NaN fails both)
        raise ConfigError(f"engine.gpu_memory_utilization={engine.gpu_memory_utilization}: must be in (0, 1], the "
                          "share of the device's memory the engine may use (0.9: vLLM's default)")
    if not 0 < engine.timeout_s < float("inf"):
        raise ConfigError(f"engine.timeout_s={engine.timeout_s}: must be a positive number of seconds")
    for key, sizes, what in (("graph_batch_sizes", engine.graph_batch_sizes, "a batch size; each must be at least 1"),
                             ("graph_token_sizes", engine.graph_token_sizes, "a token count; each must be at least 1"),
                             ("graph_kv_sizes", engine.graph_kv_sizes,
                              "a context width; each must be at least 1 token")):
        small = [size for size in sizes if size < 1]
        if small:
            raise ConfigError(f"engine.{key}: {small[0]} is not {what}")
    for key, ids in (("model.eos_token_id", [model.eos_token_id]), ("model.extra_eos_token_ids",
                                                                      model.extra_eos_token_ids)):
        outside = [token for token in ids if not 0 <= token < model.vocab_size and token != NO_EOS]
        if outside:
            raise ConfigError(f"{key}: {outside[0]} is outside the vocabulary [0, {model.vocab_size}) "
                              f"({NO_EOS}: no end-of-sequence token)")
    check_model_math(config)


def check_model_math(config: CorelibConfig) -> None:
    """The shape and the numbers the decoder computes with: a wrong one gives garbage, not an error."""
    model = config.model
    if model.num_heads % model.num_kv_heads:
        raise ConfigError(f"model.num_heads={model.num_heads} is not a multiple of model.num_kv_heads="
                          f"{model.num_kv_heads}")
    head_dim = model.head_dim or model.hidden_size // model.num_heads
    if head_dim < 2 or head_dim % 2:
        source = (f"model.head_dim={model.head_dim}" if model.head_dim else
                  f"model.hidden_size={model.hidden_size} // model.num_heads={model.num_heads} = {head_dim}")
        raise ConfigError(f"{source}: RoPE rotates pairs, so the head dimension must be even and at least 2; "
                          "set model.head_dim or change the sizes")
    for key, value in (("model.rms_norm_eps", model.rms_norm_eps), ("model.rope_theta", model.rope_theta)):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{key}={value}: must be a finite number > 0")
    for name, value in _numbers(model.rope_scaling):
        if not math.isfinite(value):
            raise ConfigError(f"model.rope_scaling.{name}={value}: must be a finite number")
    if not isinstance(architecture(model.architecture), LlamaVariant):
        return  # a plugin's architecture reads rope_scaling its own way
    scaling = RopeScaling.parse(model.rope_scaling, model.max_model_len)  # each value, naming its key
    try:  # and the table they make with this head size and base, before any weight is built
        frequencies, attention = inv_freq(head_dim, model.rope_theta, scaling)
        finite = bool(torch.isfinite(frequencies).all()) and math.isfinite(attention)
    except (ArithmeticError, ValueError):
        finite = False
    if not finite:
        raise ConfigError(f"model.rope_scaling (rope_type={scaling.rope_type if scaling else 'default'}) with "
                          f"model.rope_theta={model.rope_theta} and head_dim={head_dim}: the RoPE frequencies are not "
                          "finite numbers")


def _numbers(node: Mapping[str, Any], prefix: str = "") -> list[tuple[str, float]]:
    found: list[tuple[str, float]] = []
    for key, value in node.items():
        if isinstance(value, Mapping):
            found += _numbers(value, f"{prefix}{key}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            found.append((f"{prefix}{key}", float(value)))
    return found


def check_memory(config: CorelibConfig, spec: DeviceSpec, default_context: bool = False) -> None:
    """Refuse a KV cache and weights that cannot fit in host memory, where the device's memory is the host's.

    The stream emulator and a device that is the host allocate from this machine's memory;
    a native accelerator's free memory is known only once it is opened, so it is left to the
    device. A pool sized from memory (:mod:`corelib.startup.kv_pool`) is sized once the model is loaded;
    an explicit ``model.max_model_len`` must fit one request of it already, as the model's tables
    (RoPE's, one row per position) are built for that length first. ``default_context``: the
    model's own length, which the pool may cut.
    """
    if not spec.on_host:
        return
    available = available_host_bytes()
    if available is None:
        return
    kv, per_block, num_blocks = kv_cache_bytes(config)
    weights = weight_bytes(config)
    engine = config.engine
    if not engine.num_kv_blocks:
        one = blocks_for(config.model.max_model_len, engine.block_size) + 1  # one request, and the null block
        if not default_context and one * per_block + weights > available:
            raise ConfigError(f"model.max_model_len={config.model.max_model_len}: one request's KV cache needs "
                              f"{_gib(one * per_block)} ({one} blocks of {per_block} bytes) and the weights "
                              f"{_gib(weights)}, but {_gib(available)} of host memory are available; lower "
                              "model.max_model_len")
        kv = 0  # the rest is sized from what is left once the model is loaded, which refuses too little
    if kv + weights <= available:
        return
    have = f"{_gib(available)} of host memory are available"
    if kv >= weights:
        key = (f"engine.num_kv_blocks={engine.num_kv_blocks}" if engine.num_kv_blocks else
               f"engine.max_num_seqs={engine.max_num_seqs} x model.max_model_len={config.model.max_model_len}")
        raise ConfigError(f"{key}: the KV cache needs {_gib(kv)} ({num_blocks} blocks of {per_block} bytes) and the "
                          f"weights {_gib(weights)}, but {have}; lower engine.num_kv_blocks (or engine.max_num_seqs)")
    raise ConfigError(f"model={config.model.name}: the weights need {_gib(weights)} and the KV cache {_gib(kv)}, "
                      f"but {have}; choose a smaller model or model.dtype")


def kv_cache_bytes(config: CorelibConfig) -> tuple[int, int, int]:
    """(total bytes, bytes per block, blocks) of the paged KV cache this config allocates, null block included."""
    engine, model = config.engine, config.model
    head_dim = model.head_dim or model.hidden_size // model.num_heads
    max_blocks = -(-model.max_model_len // engine.block_size)
    num_blocks = engine.num_kv_blocks or engine.max_num_seqs * max_blocks + 1
    per_block = model.num_layers * 2 * engine.block_size * model.num_kv_heads * head_dim * _dtype_bytes(model.dtype)
    return num_blocks * per_block, per_block, num_blocks


def weight_bytes(config: CorelibConfig) -> int:
    """The parameters' bytes in the model dtype (its weight map's tensors); 0 outside the Llama family."""
    variant = architecture(config.model.architecture)
    if not isinstance(variant, LlamaVariant):
        return 0  # a plugin's architecture: its size is its own
    return weight_map(variant.shape(config.model)).parameter_count() * _dtype_bytes(config.model.dtype)


def _dtype_bytes(name: str) -> int:
    return {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}.get(name, 4)


def available_host_bytes() -> int | None:
    """Memory this process can still get: MemAvailable, capped by a cgroup v2 limit; None if unknown."""
    candidates: list[int] = []
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                candidates.append(int(line.split()[1]) * 1024)
    if not candidates:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            candidates.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    with contextlib.suppress(OSError, ValueError):
        limit = (CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            candidates.append(int(limit) - int((CGROUP / "memory.current").read_text().strip()))
    return min(candidates) if candidates else None


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"
