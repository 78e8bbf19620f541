"""Sizes derived once from the config, and the device side built from them.

The scheduler process and every worker derive the same layout from the same config, so
the arenas one packs are the arenas the other reads. The device side (model, ops, runner,
stager, handoff) is built here the same way in process and in a worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from corelib.backend import Backend
from corelib.config import CorelibConfig, Transport
from corelib.device import Device
from corelib.engine.block_manager import blocks_for
from corelib.engine.buckets import BucketPolicy
from corelib.engine.device_steps import DeviceSteps
from corelib.engine.forward_input import InputBuilder
from corelib.engine.handoff import TokenHandoff
from corelib.engine.options import EngineOptions, Staging
from corelib.engine.runner import ModelRunner
from corelib.engine.staging import build_stager
from corelib.engine.wire import prefill_layout
from corelib.errors import ConfigError
from corelib.models.base import Model
from corelib.models.registry import architecture
from corelib.models.sharding import TensorShard
from corelib.ops import Ops, load_provider

ModelFactory = Callable[[CorelibConfig, Device, TensorShard | None], Model]
SNAPSHOT_SPARE = 2  # a worker's input snapshots beyond the pipeline: one being received, one queued


@dataclass(frozen=True)
class EngineLayout:
    """Batch rows, KV blocks and staging sizes for one engine configuration."""

    rows: int
    block_size: int
    max_blocks: int
    num_blocks: int
    max_model_len: int
    max_batched_tokens: int
    graph_batch_sizes: tuple[int, ...]

    @classmethod
    def of(cls, config: CorelibConfig) -> EngineLayout:
        engine, model = config.engine, config.model
        block_size = engine.block_size
        max_blocks = blocks_for(model.max_model_len, block_size)
        num_blocks = engine.num_kv_blocks or engine.max_num_seqs * max_blocks + 1
        if num_blocks - 1 < max_blocks:
            raise ConfigError(
                f"engine.num_kv_blocks={num_blocks} holds {(num_blocks - 1) * block_size} tokens; "
                f"one request of model.max_model_len={model.max_model_len} needs {max_blocks} blocks "
                f"of {block_size} (+1 null block): raise engine.num_kv_blocks or lower model.max_model_len"
            )
        if engine.tp < 1:
            raise ConfigError(f"engine.tp={engine.tp}: must be at least 1")
        if engine.tp > 1:
            if engine.transport is not Transport.shm:
                raise ConfigError(
                    f"engine.tp={engine.tp} runs one worker process per rank, fed through shared memory: "
                    "add engine.transport=shm"
                )
            if engine.compile:
                raise ConfigError("engine.compile=true is not supported with engine.tp>1 (collectives in the "
                                  "compiled layer); drop one of them")
        architecture(model.architecture).validate(model, engine.tp)
        return cls(
            rows=engine.max_num_seqs,
            block_size=block_size,
            max_blocks=max_blocks,
            num_blocks=num_blocks,
            max_model_len=model.max_model_len,
            max_batched_tokens=engine.max_num_batched_tokens,
            graph_batch_sizes=tuple(engine.graph_batch_sizes),
        )

    @property
    def staging_bytes(self) -> int:
        """Room for the decode arena or the largest prefill arena."""
        longest = max(self.max_batched_tokens, self.max_model_len)
        return max(self.builder().decode.nbytes, prefill_layout(longest, self.rows, self.max_model_len).nbytes)

    def builder(self) -> InputBuilder:
        return InputBuilder(self.rows, self.max_blocks, self.block_size, self.rows)

    def buckets(self, options: EngineOptions, param_update: bool) -> BucketPolicy:
        return BucketPolicy.build(options.graphs, self.graph_batch_sizes, self.rows, self.max_blocks,
                                  param_update, options.attention_reads_live_blocks_only)


def load_model(config: CorelibConfig, device: Device, shard: TensorShard | None = None) -> Model:
    """The configured architecture with its weights (random, or ``model.path``) on ``device``."""
    return architecture(config.model.architecture).load(config.model, device, shard, config.engine.compile)


def build_ops(backend: Backend, device: Device, options: EngineOptions) -> Ops:
    """The reference ops, with the backend's provider in place of those it offers when the gate allows."""
    ops = Ops.reference()
    provider = backend.op_provider() if options.fused_ops else None
    if provider is None:
        return ops
    loaded = load_provider(provider, device, options.pdl)
    return ops.with_provider(provider.name, {name: op for name, op in loaded.items() if name in options.fused_ops})


def build_device_steps(
    device: Device,
    backend: Backend,
    config: CorelibConfig,
    options: EngineOptions,
    layout: EngineLayout,
    model: Model,
    staging: Staging,
) -> DeviceSteps:
    """Runner, stager and handoff on ``device``, with every decode graph captured (largest bucket first)."""
    torch.manual_seed(0)
    compute = device.stream("compute")
    handoff = TokenHandoff(device, compute, layout.rows, layout.rows, options.pipeline_depth, timing=True)
    runner = ModelRunner(device, compute, model, build_ops(backend, device, options), layout.builder(),
                         layout.buckets(options, device.capabilities.graph_param_update), handoff,
                         layout.num_blocks, layout.rows)
    snapshots = options.pipeline_depth + SNAPSHOT_SPARE if options.transport is Transport.shm else 0
    stager = build_stager(staging, device, compute, layout.staging_bytes, snapshots, config.engine.timeout_s)
    steps = DeviceSteps(runner, stager, handoff)
    try:
        if options.graphs:
            runner.capture()
    except BaseException:
        steps.close()
        raise
    return steps
