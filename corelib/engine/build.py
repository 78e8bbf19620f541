"""Sizes derived once from the config, and the device side built from them.

The scheduler process and every worker derive the same layout from the same config, so
the arenas one packs are the arenas the other reads.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from corelib.config import CorelibConfig, Transport
from corelib.device import Capabilities, Device
from corelib.engine.block_manager import blocks_for
from corelib.engine.buckets import BucketPolicy
from corelib.engine.forward_input import InputBuilder, prefill_layout
from corelib.engine.runner import ModelRunner
from corelib.errors import ConfigError
from corelib.features import Plan
from corelib.models.llama import ModelShape, ModelWeights, build_weights, random_state_dict
from corelib.models.sharding import TensorShard, check_divisible


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
            check_divisible(ModelShape.from_config(model), engine.tp)
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
        return InputBuilder(self.rows, self.max_blocks, self.block_size, self.rows, self.max_model_len)

    def buckets(self, plan: Plan, capabilities: Capabilities) -> BucketPolicy:
        return BucketPolicy.build(plan.is_enabled("graph"), self.graph_batch_sizes, self.rows, self.max_blocks,
                                  capabilities.graph_param_update)


def model_weights(config: CorelibConfig, device: Device, shard: TensorShard | None = None) -> ModelWeights:
    """Random seeded weights, or a checkpoint when ``model.path`` is set; ``shard``: one rank's part."""
    if config.model.path:
        from corelib.models.checkpoint import load_checkpoint

        return load_checkpoint(config.model, device.torch_device, shard)
    shape = ModelShape.from_config(config.model)
    state = _random_state(shape, config.model.seed)  # the full model, identical on every rank
    if shard is None:
        return build_weights(shape, state, device.torch_device)
    local = {name: shard.slice(name, tensor) for name, tensor in state.items()}
    return build_weights(shard.shape(shape), local, device.torch_device)


@functools.lru_cache(maxsize=1)
def _random_state(shape: ModelShape, seed: int) -> dict[str, torch.Tensor]:
    # Engines built one after another in a process (bench, tests) reuse the host copy.
    return random_state_dict(shape, seed)


def build_runner(
    device: Device,
    config: CorelibConfig,
    plan: Plan,
    layout: EngineLayout,
    weights: ModelWeights,
    ordered_prepare: bool = False,
) -> ModelRunner:
    """The model runner with its graphs captured (largest bucket first)."""
    torch.manual_seed(0)
    runner = ModelRunner(
        device,
        weights,
        layout.builder(),
        layout.buckets(plan, device.capabilities),
        layout.num_blocks,
        layout.rows,
        compile_decode=config.engine.compile,
        ordered_prepare=ordered_prepare,
    )
    try:
        if plan.is_enabled("graph"):
            runner.capture()
    except BaseException:
        runner.close()
        raise
    return runner
