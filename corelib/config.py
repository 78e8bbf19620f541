"""Typed schemas for every config group, registered in Hydra's ConfigStore.

The YAML tree in ``conf/`` is validated against these at compose time, so a misspelled key
or a value of the wrong type fails naming its ``full_key`` before anything runs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class Mode(str, enum.Enum):
    """A feature switch: decided by its gate, forced on (refuse if impossible), or off."""

    auto = "auto"
    on = "on"
    off = "off"


class RuntimeMode(str, enum.Enum):
    """Where a backend runs: its hardware if present, only its hardware, or the stream emulator."""

    auto = "auto"
    native = "native"
    emulated = "emulated"


class Materialization(str, enum.Enum):
    """Who issues the H2D of an SHM frame: its gate decides, the polling thread, or the prepare stream."""

    auto = "auto"
    early = "early"
    ordered = "ordered"


class Transport(str, enum.Enum):
    """How scheduled steps reach the model: in this process, or through a shared-memory ring."""

    inproc = "inproc"
    shm = "shm"


# How a feature requirement compares its fact with its value. OmegaConf matches enum values
# by member name, and a gate file says ``op: in``, so the members are named by the words of
# the YAML; ``in`` is a keyword, hence the functional form (``Op["in"]`` in Python).
Op = enum.Enum(
    "Op",
    [("eq", "eq"), ("ne", "ne"), ("in", "in"), ("not_in", "not_in"), ("ge", "ge"), ("le", "le")],
    type=str,
)


class Scope(str, enum.Enum):
    """When a requirement is checked: once at start, or for every scheduled step."""

    start = "start"
    step = "step"


@dataclass
class EmulatorConfig:
    """The stream emulator's chaos and cost model (``backend.emulator``)."""

    chaos: float = 0.0  # share of stream operations that get a random delay, in [0, 1]
    chaos_max_ms: float = 2.0  # upper bound of one chaos delay
    seed: int = 0  # seed of the chaos delays
    launch_latency_us: float = 0.0  # cost model: extra time per launched closure
    copy_gb_per_s: float = 0.0  # cost model: copy bandwidth; 0 means copies cost their CPU time only


@dataclass
class BackendConfig:
    """``backend/<name>.yaml``: which plugin, which runtime, and the declared capabilities."""

    name: str = MISSING  # backend plugin name, or "auto"
    runtime: RuntimeMode = RuntimeMode.auto  # auto: native if possible, else emulated
    device_index: int = 0  # which device of the backend's kind
    capabilities: dict[str, Any] = field(default_factory=dict)  # declared; a probe may narrow them
    emulator: EmulatorConfig = field(default_factory=EmulatorConfig)
    candidates: list[str] = field(default_factory=list)  # backend=auto: try these natively, in order
    fallback: str = ""  # backend=auto: used when no candidate runs natively


@dataclass
class ModelConfig:
    """``model/<name>.yaml``: the decoder's shape and where its weights come from."""

    name: str = MISSING  # preset name, shown in reports
    architecture: str = "llama"  # llama, qwen2, qwen3, or hybrid (llama + recurrent conv state)
    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0  # 0 means hidden_size // num_heads
    intermediate_size: int = 384
    max_model_len: int = 512  # longest prompt + output a request may have
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    dtype: str = "float32"  # float32, bfloat16, float16, or auto: the checkpoint's dtype (float32 without one)
    seed: int = 0  # seed of the random weights
    eos_token_id: int = 1
    extra_eos_token_ids: list[int] = field(default_factory=list)  # more ids that end a request like eos_token_id
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qkv bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    conv_kernel: int = 4  # hybrid only: width of the causal convolution state
    multimodal: bool = False  # the model takes non-text inputs
    path: str | None = None  # a Hugging Face checkpoint directory; None means random weights
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # config.json's rope_scaling; {}: plain RoPE


@dataclass
class ShmConfig:
    """``engine.shm``: the shared-memory ring between scheduler and workers."""

    materialization: Materialization = Materialization.auto  # early: polling thread issues the H2D
    num_slots: int = 4  # frames in the ring
    slot_bytes: int = 1 << 20  # bytes per frame, header included
    register_host: bool = False  # pin the SHM region in place (shows the race on real DMA)
    spin_us: float = 150.0  # a waiting end re-checks the ring this long (yielding the GIL) before it sleeps


@dataclass
class EngineConfig:
    """``engine/<name>.yaml``: optimizations, transport, KV cache and batching."""

    graph: Mode = Mode.auto  # capture decode steps as device graphs
    async_token_handoff: Mode = Mode.auto  # overlap step N+1 on the device with step N on the host
    run_ahead: int = 1  # with async handoff: steps the scheduler submits beyond the one it reads (1 or 2)
    fused_ops: Mode = Mode.auto  # the backend's fused kernels in place of the reference ops
    transport: Transport = Transport.inproc  # inproc, or shm to worker processes
    shm: ShmConfig = field(default_factory=ShmConfig)
    kv_cache: str = "paged"  # the only layout implemented; the gates ask for it
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int = 0  # 0 sizes the pool for max_num_seqs full-length requests
    max_num_seqs: int = 64  # most requests decoding at once
    max_num_batched_tokens: int = 2048  # prefill token budget per step
    graph_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    compile: bool = False  # torch.compile the decode step (inside the graph where graphs are on)
    speculative_draft_model: str | None = None  # not implemented; the gates ask for it
    kv_transfer_connector: str | None = None  # not implemented; the gates ask for it
    tp: int = 1  # tensor-parallel ranks
    timeout_s: float = 60.0  # longest any wait may take before it fails naming what it waited for
    trace: bool = False  # write a Chrome/Perfetto trace of host and device spans
    metrics_window: int = 10_000  # latest requests and steps kept for percentiles; totals cover all


@dataclass
class WorkloadConfig:
    """``workload/<name>.yaml``: the synthetic requests of a run."""

    num_requests: int = 16
    prompt_len_min: int = 8
    prompt_len_max: int = 32
    output_len_min: int = 16
    output_len_max: int = 32
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0
    seed: int = 0  # prompts, lengths and sampling seeds
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop_string_fraction: float = 0.0  # share of requests with host-side stop strings
    multimodal_fraction: float = 0.0  # share of requests flagged multimodal
    prompts: list[str] = field(default_factory=list)  # text prompts (needs a tokenizer)


@dataclass
class RequirementConfig:
    """One condition of a feature gate: ``fact op value``, and the sentence shown when it fails."""

    fact: str = MISSING  # capabilities.*, config.*, model.*, features.*, request.*
    reason: str = MISSING  # the sentence shown when the requirement fails
    op: Op = Op.eq
    value: Any = True
    scope: Scope = Scope.start
    auto_only: bool = False  # a benefit condition: `auto` needs it, `on` does not


@dataclass
class FeatureConfig:
    """``features/<name>.yaml``: one feature gate."""

    # Where the mode is set: another config key (``mode_key``, e.g. engine.graph), or ``mode``
    # right here, so a gate added as YAML alone is switched with features.<name>.mode=on.
    mode_key: str = ""  # config key holding the feature's mode; empty: use ``mode``
    mode: Mode | None = None  # the mode of a gate without mode_key
    mode_map: dict[str, str] = field(default_factory=dict)  # maps mode values to auto/on/off
    description: str = ""  # one line, shown by `plan`
    requirements: list[RequirementConfig] = field(default_factory=list)


@dataclass
class PluginsConfig:
    """``plugins``: which backend plugins may load."""

    allow: list[str] | None = None  # load only these plugins (None: all)
    block: list[str] = field(default_factory=list)  # never load these plugins


@dataclass
class BenchConfig:
    """``bench/<name>.yaml``: the sweep of ``python -m corelib bench``."""

    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    handoff: list[str] = field(default_factory=lambda: ["off", "on"])
    transport: list[str] = field(default_factory=lambda: ["inproc"])
    materialization: list[str] = field(default_factory=lambda: ["auto"])
    backends: list[str] = field(default_factory=list)  # empty: the selected backend only
    tp: list[int] = field(default_factory=lambda: [1])  # tensor-parallel ranks; tp > 1 runs over shm
    prompt_len: int = 32
    output_len: int = 64
    warmup_steps: int = 4
    repeats: int = 1


@dataclass
class CorelibConfig:
    """The root of the composed config."""

    backend: BackendConfig = MISSING
    model: ModelConfig = MISSING
    engine: EngineConfig = MISSING
    workload: WorkloadConfig = MISSING
    features: dict[str, FeatureConfig] = field(default_factory=dict)
    plugins: PluginsConfig = field(default_factory=PluginsConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)


def register_schemas() -> None:
    """Store the schemas in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="corelib_schema", node=CorelibConfig)
