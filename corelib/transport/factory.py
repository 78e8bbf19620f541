"""One executor factory per transport: the engine looks its transport up here and never branches on it."""

from __future__ import annotations

from collections.abc import Callable

from corelib.config.options import EngineOptions
from corelib.config.schema import Transport
from corelib.startup.kv_pool import sized_layout
from corelib.startup.start import Startup
from corelib.step.arena import ArenaPool
from corelib.step.build import ModelFactory, build_device_steps
from corelib.step.layout import EngineLayout
from corelib.transport.executor import SPARE_ARENAS, Executor, InprocExecutor
from corelib.transport.memory_probe import shm_layout
from corelib.transport.nodes import Topology
from corelib.transport.shm_executor import ShmExecutor


def build_inproc(
    startup: Startup, options: EngineOptions, layout: EngineLayout, model_factory: ModelFactory
) -> Executor:
    """Open the device, load the model and capture its graphs in this process."""
    Topology.from_environment(startup.config.engine.tp)  # refuses torchrun --nnodes>1 for one rank
    device = startup.backend.open(startup.spec)
    try:
        model = model_factory(startup.config, device, None)
        layout, pool = sized_layout(startup, options, layout, device, model)  # the KV pool from what is left
        steps = build_device_steps(device, startup.backend, startup.config, options, layout, model, options.staging)
        pinned = not device.capabilities.device_is_host and device.capabilities.pinned_host
        arenas = ArenaPool(lambda shape, dtype: device.host_empty(shape, dtype, pinned=pinned),
                           layout.arena_bytes, options.pipeline_depth + SPARE_ARENAS, startup.config.engine.timeout_s)
    except BaseException:
        device.close()
        raise
    executor = InprocExecutor(device, steps, arenas)
    executor.layout = layout
    executor.notices.extend(pool)
    return executor


def build_shm(
    startup: Startup, options: EngineOptions, layout: EngineLayout, model_factory: ModelFactory
) -> Executor:
    """Start the worker processes; each loads its own model (``model_factory`` is not used across processes)."""
    del model_factory
    layout, lines = shm_layout(startup, options, layout, Topology.from_environment(startup.config.engine.tp))
    executor = ShmExecutor(startup, options, layout)
    executor.layout = layout
    executor.notices.extend(lines)
    return executor


ExecutorFactory = Callable[[Startup, EngineOptions, EngineLayout, ModelFactory], Executor]
EXECUTORS: dict[Transport, ExecutorFactory] = {Transport.inproc: build_inproc, Transport.shm: build_shm}
