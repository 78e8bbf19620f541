"""The device side of an engine (model, ops, runner, stager, handoff), built the same way in
process and in a worker, from the sizes of :class:`~corelib.step.layout.EngineLayout`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from corelib.config.options import EngineOptions, Staging
from corelib.config.schema import CorelibConfig, Transport
from corelib.models.base import FoldsNorms, Model
from corelib.models.registry import architecture
from corelib.models.sharding import TensorShard
from corelib.ops import Ops, load_provider
from corelib.ops.reference import reference_ops
from corelib.platform.backend import Backend
from corelib.platform.device import Device
from corelib.step.device_steps import DeviceSteps
from corelib.step.handoff import TokenHandoff
from corelib.step.layout import EngineLayout
from corelib.step.runner import ModelRunner
from corelib.step.staging import build_stager, reads_ring_in_place

ModelFactory = Callable[[CorelibConfig, Device, TensorShard | None], Model]
SNAPSHOT_SPARE = 2  # a worker's input snapshots beyond the pipeline: one being received, one queued


def load_model(config: CorelibConfig, device: Device, shard: TensorShard | None = None) -> Model:
    """The configured architecture with its weights (random, or ``model.path``) on ``device``."""
    return architecture(config.model.architecture).load(config.model, device, shard, config.engine.compile)


def build_ops(backend: Backend, device: Device, options: EngineOptions) -> Ops:
    """The reference ops, with the backend's provider in place of those it offers when the gate allows."""
    ops = reference_ops()
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
    """Runner, stager and handoff on ``device``; every decode graph captured now (largest bucket first),
    unless capture is lazy (then each the first time a step needs it)."""
    torch.manual_seed(0)
    if options.fold_norms and isinstance(model, FoldsNorms):
        model.fold_norm_weights()  # before any graph is captured: the graphs read the folded weights
    compute = device.stream("compute")
    handoff = TokenHandoff(device, compute, layout.rows, layout.rows, options.pipeline_depth, timing=True)
    runner = ModelRunner(device, compute, model, build_ops(backend, device, options), layout,
                         layout.buckets(options, device.capabilities.graph_param_update), handoff,
                         config.model.vocab_size, deferred_masks=options.structured_overlap)
    shm = options.transport is Transport.shm
    snapshots = options.pipeline_depth + SNAPSHOT_SPARE if shm else 0
    stager = build_stager(staging, device, compute, layout.arena_bytes, snapshots, config.engine.timeout_s,
                          in_place=shm and reads_ring_in_place(staging, device))
    steps = DeviceSteps(runner, stager, handoff)
    try:
        # The set-up above ran on this thread's current stream (the KV cache and the relays zeroed, the token
        # mask filled, the norms folded into the weights), and nothing orders that stream before the compute
        # stream, which reads all of it from the first warm-up or step on: wait for it once, here.
        device.synchronize()
        if options.graphs and not options.lazy_capture:
            runner.capture()
    except BaseException:
        steps.close()
        raise
    return steps
