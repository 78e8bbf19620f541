"""How many KV blocks the pool gets: ``engine.gpu_memory_utilization`` of the device's memory, less what the
engine needs besides (vLLM's sizing).

Once the weights are on the device, one step at the largest token budget is profiled (its peak
measured where the device's allocator keeps one, estimated from the model's shape where it does
not); what is left of the fraction of the device's memory, after the memory in use, that peak and
an estimate of the captured graphs, becomes KV blocks::

    blocks = (fraction x total - in use - peak activations - graphs) / bytes per block

also never more than is free now (another process may hold part of the device). Where the
device's memory is the host's (the cpu backend, the stream emulator) the same fraction applies
to the host's memory. The fraction is a ceiling, as vLLM's is, but unlike vLLM the pool is also
at most what ``engine.max_num_seqs`` requests of ``model.max_model_len`` need: a checkpoint's own
context (40,960 tokens for Qwen3) reaches the ceiling at once, while a short context does not
take nine tenths of a device for blocks no request would use (only cached prefixes would), and
engines side by side on one device (a test suite, a benchmark's two sides, a second process) each
start. ``engine.num_kv_blocks > 0`` sets the pool outright.

``model.max_model_len`` left at its default (the checkpoint's ``max_position_embeddings``) is cut to
what the pool holds when the pool cannot hold one such request, with a line that says so; one
set explicitly is refused in one line instead. Sequences share the pool, and preemption handles
pressure, as before.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from corelib.config.schema import CorelibConfig
from corelib.errors import ConfigError
from corelib.models.shape import DTYPES
from corelib.platform.device import Device
from corelib.step.buckets import blocks_for

if TYPE_CHECKING:
    from corelib.config.options import EngineOptions
    from corelib.models.base import Model
    from corelib.startup.start import Startup
    from corelib.step.layout import EngineLayout

SLOT_TOKEN_BYTES = 8  # the runner's int64 token id per KV slot (the penalties count a row's tokens from its blocks)
LOGITS_COPIES = 4  # a step's float32 logits: the model's, the sampler's scaled and sorted copies, the softmax
ACTIVATION_MARGIN = 2.0  # an estimated peak counts twice: temporaries the shape alone does not show
MIN_GRAPH_BYTES = 64 << 20  # graphs' pool at least this, where graphs are captured and nothing was measured
RUNTIME_HEADROOM = 1 << 30  # a worker's runtime context and allocator rounding, where the pool is sized first


@dataclass(frozen=True)
class MemoryFigures:
    """What the sizing knows of the device's memory once the weights are loaded, in bytes."""

    total: int  # the memory the device allocates from
    free: int  # free now, to this process and every other
    used: int  # what this engine holds now (its weights, buffers)
    activations: int  # the peak of the largest step beyond ``used``
    graphs: int  # what the captured graphs will hold
    measured: bool  # activations measured by a profiled step; else estimated from the shape
    where: str  # "device memory" or "host memory"


@dataclass(frozen=True)
class KvPool:
    """The pool's size, the context it allows, and the lines that say why."""

    num_blocks: int  # the null block included
    block_size: int
    max_model_len: int
    block_bytes: int
    lines: tuple[str, ...]

    @property
    def tokens(self) -> int:
        """Tokens the pool holds (the null block holds none)."""
        return (self.num_blocks - 1) * self.block_size


def block_bytes(config: CorelibConfig) -> int:
    """Bytes one KV block takes on one rank: keys and values of every layer (the rank's share of the KV heads),
    and the token id the runner keeps per slot."""
    model, engine = config.model, config.engine
    head_dim = model.head_dim or model.hidden_size // model.num_heads
    heads = max(1, model.num_kv_heads // max(1, engine.tp))
    dtype = DTYPES.get(model.dtype, torch.float32).itemsize
    return engine.block_size * (model.num_layers * 2 * heads * head_dim * dtype + SLOT_TOKEN_BYTES)


def profile_tokens(config: CorelibConfig, chunked: bool) -> int:
    """Tokens of the largest step: the token budget, or a whole prompt where prompts are not chunked."""
    engine = config.engine
    largest = max(engine.max_num_batched_tokens, engine.max_num_seqs)
    return largest if chunked else max(largest, config.model.max_model_len)


def estimate_activations(config: CorelibConfig, tokens: int) -> int:
    """The peak a step of ``tokens`` tokens adds, from the model's shape (where the device keeps no peak).

    Per token: the residual and its norm, q/k/v and the attention's output, the MLP's gate, up and
    their product, each in the model's dtype, a float32 norm; per row the float32 logits and the
    sampler's copies. Counted :data:`ACTIVATION_MARGIN` times over, as an estimate must be safe.
    """
    model, engine = config.model, config.engine
    tp = max(1, engine.tp)
    head_dim = model.head_dim or model.hidden_size // model.num_heads
    q, kv = model.num_heads * head_dim // tp, max(1, model.num_kv_heads // tp) * head_dim
    dtype = DTYPES.get(model.dtype, torch.float32).itemsize
    per_token = (2 * model.hidden_size + q + 2 * kv + q + 3 * model.intermediate_size // tp) * dtype \
        + model.hidden_size * 4
    rows = min(tokens, engine.max_num_seqs)
    logits = rows * model.vocab_size * 4 * LOGITS_COPIES
    return int(ACTIVATION_MARGIN * (tokens * per_token + logits))


def size_pool(config: CorelibConfig, figures: MemoryFigures | None, default_context: bool) -> KvPool:
    """The pool for ``config`` from ``figures`` (None: the device cannot say how much memory it has).

    ``default_context``: ``model.max_model_len`` is the model's own limit, not the user's, so it may be
    cut to what the pool holds. Refuses, in one line naming the key, a pool that holds no block, or not
    one request of an explicit ``model.max_model_len``.
    """
    engine, model = config.engine, config.model
    size, context = engine.block_size, model.max_model_len
    per_block = block_bytes(config)
    per_request = blocks_for(context, size)
    demand = engine.max_num_seqs * per_request + 1
    if engine.num_kv_blocks:
        pool = KvPool(engine.num_kv_blocks, size, context, per_block, ())
        return _described(pool, "engine.num_kv_blocks")
    if figures is None:
        pool = KvPool(demand, size, context, per_block, ())
        return _described(pool, f"engine.max_num_seqs={engine.max_num_seqs} requests of model.max_model_len="
                                f"{context} (the device does not report its memory; engine.num_kv_blocks sizes the "
                                "pool)")
    fraction = engine.gpu_memory_utilization
    allowed = min(int(fraction * figures.total) - figures.used, figures.free)
    budget = allowed - figures.activations - figures.graphs
    by_memory = max(0, budget // per_block)
    account = (f"engine.gpu_memory_utilization={fraction:g} of {_size(figures.total)} {figures.where}"
               + (f" (only {_size(figures.free)} free)" if allowed == figures.free else "")
               + f" after {_size(figures.used)} in use and {_size(figures.activations)} for the largest step "
               + f"({'profiled' if figures.measured else 'estimated'})"
               + (f" and {_size(figures.graphs)} for graphs" if figures.graphs else ""))
    if by_memory < 2:  # the null block and one block for a request
        raise ConfigError(f"{account} leaves {_size(max(budget, 0))} for the KV cache, not two blocks of "
                          f"{_size(per_block)}: raise engine.gpu_memory_utilization, lower "
                          "engine.max_num_batched_tokens, or choose a smaller model or model.dtype")
    num_blocks = min(demand, by_memory)
    why = (f"what engine.max_num_seqs={engine.max_num_seqs} requests of model.max_model_len={context} need "
           f"({account} would allow {by_memory})") if num_blocks == demand else account
    holds = (num_blocks - 1) * size
    notes: list[str] = []
    if holds < context:
        if not default_context:
            raise ConfigError(f"model.max_model_len={context} needs {per_request} KV blocks of {size} tokens, but "
                              f"{account} leaves room for {num_blocks - 1} ({holds} tokens): raise "
                              "engine.gpu_memory_utilization, lower model.max_model_len, or set engine.num_kv_blocks")
        notes.append(f"model.max_model_len={holds}: cut from the model's {context}, as the KV pool holds {holds} "
                     "tokens (raise engine.gpu_memory_utilization, or set model.max_model_len)")
        context = holds
    pool = _described(KvPool(num_blocks, size, context, per_block, ()), why)
    return dataclasses.replace(pool, lines=(*pool.lines, *notes))


def _described(pool: KvPool, why: str) -> KvPool:
    line = (f"KV pool: {pool.num_blocks} blocks of {pool.block_size} tokens ({pool.tokens} tokens, "
            f"{_size(pool.num_blocks * pool.block_bytes)}): {why}")
    return dataclasses.replace(pool, lines=(line,))


def _size(nbytes: int) -> str:
    if abs(nbytes) >= 1 << 30:
        return f"{nbytes / 2**30:.1f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


def memory_figures(config: CorelibConfig, options: EngineOptions, host: bool, device: Device | None,
                   model: Model | None, probed: tuple[int, int] | None = None) -> MemoryFigures | None:
    """What the device says of its memory, with the largest step's peak: profiled on ``model`` where the device
    keeps a peak, else estimated. ``host``: the device's memory is the host's. ``probed``: (free, total) of an
    accelerator in other processes, read before they load anything (:mod:`corelib.transport.memory_probe`).
    None where nothing says how much memory there is."""
    from corelib.platform.memory import host_memory
    from corelib.startup.limits import weight_bytes

    info = device.memory_info() if device is not None else probed if probed is not None else \
        host_memory() if host else None
    if info is None:
        return None
    free, total = info  # read before the profile: what it takes stays cached for the steps' own use
    tokens = profile_tokens(config, options.chunked_prefill)
    measured = None
    if device is not None and model is not None and device.peak_memory_bytes() is not None:
        measured = profile_step(device, model, config, tokens)
    if device is not None and not host:
        used = device.memory_stats().device_bytes
    else:  # weights in host memory no device ledger counts, or in workers that have not loaded them yet
        used = weight_bytes(config) // max(1, config.engine.tp)
    if device is None and not host:  # probed: the workers' weights and runtime contexts will take from free
        free -= RUNTIME_HEADROOM + used
    activations = measured if measured is not None else estimate_activations(config, tokens)
    graphs = max(MIN_GRAPH_BYTES, activations // 4) if options.graphs and not host else 0
    return MemoryFigures(total, free, used, activations, graphs, measured is not None,
                         "host memory" if host else "device memory")


def profile_step(device: Device, model: Model, config: CorelibConfig, tokens: int) -> int:
    """The peak bytes one forward of ``tokens`` prompt tokens adds on ``device``, beyond what it holds before.

    The tokens are split into rows of at most ``model.max_model_len`` (their positions stay inside the
    RoPE table), each row a prompt in blocks of its own of a temporary KV cache, freed after.
    """
    from corelib.models.base import StepBatch
    from corelib.ops import PagedAttention
    from corelib.ops.reference import reference_ops

    size = config.engine.block_size
    row_len = min(tokens, config.model.max_model_len)
    rows = math.ceil(tokens / row_len)
    width = blocks_for(row_len, size)
    stream = device.stream("profile")
    device.synchronize()
    before = device.memory_stats().device_bytes
    device.reset_peak_memory()
    state = model.allocate_state(device, rows * width + 1, size, rows)
    allocated = device.memory_stats().device_bytes - before

    def forward() -> None:
        lens = [min(row_len, tokens - row * row_len) for row in range(rows)]
        on = device.torch_device
        positions = torch.cat([torch.arange(n, device=on) for n in lens])
        slots = torch.cat([torch.arange(n, device=on) + size * (1 + row * width) for row, n in enumerate(lens)])
        tables = (torch.arange(rows * width, device=on) + 1).view(rows, width)
        starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=on)
        seq_lens = torch.tensor(lens, device=on)
        attention = PagedAttention(tables, seq_lens, size, starts, row_len)
        batch = StepBatch(torch.zeros(tokens, dtype=torch.int64, device=on), positions, slots, attention,
                          torch.arange(rows, device=on), starts[1:] - 1)
        model.forward(batch, state, reference_ops())

    stream.launch(forward)
    stream.synchronize()
    peak = device.peak_memory_bytes() or before
    return max(0, peak - before - allocated)  # the temporary cache goes with this frame


def sized_layout(startup: Startup, options: EngineOptions, layout: EngineLayout, device: Device | None = None,
                 model: Model | None = None, probed: tuple[int, int] | None = None,
                 ) -> tuple[EngineLayout, tuple[str, ...]]:
    """``layout`` with its KV pool sized for ``startup`` (on ``device`` with ``model`` loaded, where they are in
    this process), and the lines for the startup report.

    A context cut to the pool is written into the config (the scheduler, the server and the workers read
    it there); so is the block count where the model runs in other processes (``device`` None: each
    worker derives its layout from the config), sized from the host's memory where that is the
    device's, else from ``probed`` (the accelerator's memory, read before the workers start), else
    from what the requests need.
    """
    config, spec = startup.config, startup.spec
    host = spec.on_host
    figures = None if config.engine.num_kv_blocks else memory_figures(config, options, host, device, model, probed)
    pool = size_pool(config, figures, startup.default_context)
    if pool.max_model_len != config.model.max_model_len:
        config.model.max_model_len = pool.max_model_len
        startup.raw.model.max_model_len = pool.max_model_len
    if device is None:
        config.engine.num_kv_blocks = pool.num_blocks
        startup.raw.engine.num_kv_blocks = pool.num_blocks
    engine = dataclasses.replace(config.engine, num_kv_blocks=pool.num_blocks)
    return type(layout).of(dataclasses.replace(config, engine=engine)), pool.lines


def describe_policy(startup: Startup) -> str:
    """One line for ``plan``: how the pool will be sized (its block count needs the loaded model: the startup
    report of ``run`` and ``serve`` says it)."""
    config, spec = startup.config, startup.spec
    engine, model = config.engine, config.model
    if engine.num_kv_blocks:
        return (f"KV pool: engine.num_kv_blocks={engine.num_kv_blocks} blocks of {engine.block_size} tokens "
                f"({(engine.num_kv_blocks - 1) * engine.block_size} tokens)")
    fraction = engine.gpu_memory_utilization
    context = ("model.max_model_len=" + str(model.max_model_len)
               + (" (the model's own, cut to the pool if it cannot hold one)" if startup.default_context else ""))
    demand = engine.max_num_seqs * blocks_for(model.max_model_len, engine.block_size) + 1
    step = profile_tokens(config, startup.options.chunked_prefill)
    where = ("the host's memory" if spec.on_host else
             f"the device's memory less the weights, a step of {step} tokens and the graphs")
    return (f"KV pool: what engine.max_num_seqs={engine.max_num_seqs} requests of {context} need ({demand} blocks), "
            f"at most engine.gpu_memory_utilization={fraction:g} of {where}; sized at start (the startup report gives "
            "its blocks)")
