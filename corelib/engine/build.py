"""The request loop assembled from its parts: one factory, so the Engine and the unit tests build it alike.

``build_engine_core`` wires the scheduler (with its KV blocks and stop checks), the packer, the
graph buckets and the step pipeline around an executor it is handed: the Engine passes the
transport's executor (:mod:`corelib.transport.factory`), a unit test a scripted one
(:mod:`corelib.testing.executor`) that needs no device.
"""

from __future__ import annotations

from corelib.config.options import EngineOptions
from corelib.config.schema import CorelibConfig
from corelib.engine.block_manager import BlockManager
from corelib.engine.core import EngineCore
from corelib.engine.packing import InputBuilder
from corelib.engine.scheduler import Scheduler, SchedulerLimits
from corelib.engine.stops import StopChecker
from corelib.step.layout import EngineLayout
from corelib.step.pipeline import StepPipeline
from corelib.support.text import Tokenizer
from corelib.transport.executor import Executor


def model_identity(config: CorelibConfig) -> str:
    """What a cached KV block's key depends on besides its tokens: every model setting (weights, shape,
    dtype, RoPE), so blocks are never shared across models."""
    return repr(config.model)


def build_engine_core(
    config: CorelibConfig,
    options: EngineOptions,
    layout: EngineLayout,
    executor: Executor,
    tokenizer: Tokenizer | None = None,
    graph_param_update: bool = False,
) -> EngineCore:
    """The loop of one engine around ``executor``; ``tokenizer`` decodes text for stop strings."""
    engine, model = config.engine, config.model
    eos = frozenset({model.eos_token_id, *model.extra_eos_token_ids})
    scheduler = Scheduler(
        SchedulerLimits(layout.rows, engine.max_num_batched_tokens, model.max_model_len, options.chunked_prefill,
                        options.share_prompt_blocks),
        BlockManager(layout.num_blocks, layout.block_size, options.prefix_caching, model_identity(config)),
        num_states=layout.rows,
        stops=StopChecker(model.max_model_len, eos, tokenizer.decode if tokenizer else None,
                          tokenizer.decode_special if tokenizer else None),
    )
    if options.structured_overlap and not executor.defers_masks:
        raise ValueError(f"structured_overlap is on but {type(executor).__name__} cannot take a step before its "
                         f"grammar mask")
    builder = InputBuilder(layout, defer_masks=options.structured_overlap, eager_only=not options.graphs)
    return EngineCore(
        scheduler, builder, layout.buckets(options, graph_param_update), executor,
        StepPipeline(options.pipeline_depth), options.step_check, engine.timeout_s, engine.metrics_window,
    )
