"""Typed schemas for every config group, registered in Hydra's ConfigStore.

The YAML tree in ``conf/`` is validated against these at compose time, so a misspelled key
or a value of the wrong type fails naming its ``full_key`` before anything runs.

A feature gate may name an engine key that no dataclass declares as its ``mode_key``
(``engine.<name>``): :func:`declare_gate_keys` adds it, as a mode defaulting to ``auto``, to the
engine schema (:func:`engine_schema`), so a new gate touches no Python here.

Long: it is one thing, the schema of the composed config: a dataclass per group, each key with
its default and a line of help (``COMMAND --help`` prints them), and the enums the keys take.
Most lines are that help text. Compose, ``--help`` and the tests of the config tree read the
schema as a whole; split by group, it would be one schema spread over several files.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from corelib.errors import ConfigError


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


class WeightInit(str, enum.Enum):
    """Where random weights are generated: decided by the model's size, on the CPU, or on the model's device."""

    auto = "auto"
    cpu = "cpu"
    device = "device"


class GraphCapture(str, enum.Enum):
    """When decode graphs are captured: at start (every bucket), or the first time a step needs one."""

    auto = "auto"
    upfront = "upfront"
    lazy = "lazy"


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


def doc(text: str) -> dict[str, str]:
    """A key's meaning, as dataclass field metadata; ``COMMAND --help`` shows it beside the key."""
    return {"help": text}


@dataclass
class EmulatorConfig:
    """The stream emulator's chaos and cost model (``backend.emulator``)."""

    chaos: float = field(default=0.0, metadata=doc("share of stream operations that get a random delay, in [0, 1]"))
    chaos_max_ms: float = field(default=2.0, metadata=doc("upper bound of one chaos delay, in ms"))
    seed: int = field(default=0, metadata=doc("seed of the chaos delays"))
    launch_latency_us: float = field(default=0.0, metadata=doc("cost model: extra time per launched closure, in µs"))
    copy_gb_per_s: float = field(
        default=0.0, metadata=doc("cost model: copy bandwidth in GB/s; 0: copies cost their CPU time only")
    )


@dataclass
class BackendConfig:
    """``backend/<name>.yaml``: which plugin, which runtime, and the declared capabilities."""

    name: str = field(
        default=MISSING, metadata=doc("backend plugin name (python -m corelib backends lists them), or auto")
    )
    runtime: RuntimeMode = field(
        default=RuntimeMode.auto,
        metadata=doc(
            "native: only on the hardware; emulated: the stream emulator; "
            "auto: native where the hardware is, else emulated"
        ),
    )
    device_index: int = field(default=0, metadata=doc("which device of the backend's kind"))
    capabilities: dict[str, Any] = field(
        default_factory=dict, metadata=doc("what the device can do, as declared; a probe may only narrow it")
    )
    emulator: EmulatorConfig = field(
        default_factory=EmulatorConfig, metadata=doc("the stream emulator's chaos and cost model")
    )
    candidates: list[str] = field(default_factory=list, metadata=doc("backend=auto: tried natively, in this order"))
    fallback: str = field(default="", metadata=doc("backend=auto: used when no candidate runs natively"))


@dataclass
class ModelConfig:
    """``model/<name>.yaml``: the decoder's shape and where its weights come from."""

    name: str = field(default=MISSING, metadata=doc("preset name, shown in reports"))
    architecture: str = field(
        default="llama",
        metadata=doc("a registered architecture: the Llama family's variants (corelib/models/registry.py; hybrid is "
                     "llama + a recurrent conv state) or a plugin's"),
    )
    vocab_size: int = field(default=512, metadata=doc("token ids are 0 .. vocab_size-1"))
    hidden_size: int = field(default=128, metadata=doc("model width"))
    num_layers: int = field(default=2, metadata=doc("decoder layers"))
    num_heads: int = field(default=4, metadata=doc("query heads"))
    num_kv_heads: int = field(default=2, metadata=doc("key/value heads (grouped-query attention)"))
    head_dim: int = field(default=0, metadata=doc("per-head width; 0: hidden_size / num_heads"))
    intermediate_size: int = field(default=384, metadata=doc("SwiGLU width"))
    max_model_len: int = field(
        default=0,
        metadata=doc("longest prompt + output a request may have; 0: max_position_embeddings (the checkpoint's), cut "
                     "to what the KV pool holds when it cannot hold one such request"),
    )
    max_position_embeddings: int = field(
        default=512, metadata=doc("the longest context the model was trained for; a checkpoint's config.json sets it")
    )
    rope_theta: float = field(default=10000.0, metadata=doc("RoPE base"))
    rms_norm_eps: float = field(default=1e-6, metadata=doc("RMSNorm epsilon"))
    dtype: str = field(
        default="auto",
        metadata=doc("float32, bfloat16, float16, or auto: the checkpoint's dtype on an accelerator (native or "
                     "emulated), float32 where the device is the host (the cpu backend) or without a checkpoint"),
    )
    seed: int = field(default=0, metadata=doc("seed of the random weights"))
    init: WeightInit = field(
        default=WeightInit.auto,
        metadata=doc(
            "random weights: cpu (one float32 stream, the same on every device), device (each tensor "
            "on the model's device from a generator seeded by seed and its name: fast), auto: cpu up "
            "to 1 B parameters, device above"
        ),
    )
    eos_token_id: int = field(default=1, metadata=doc("end-of-sequence token id; -1: none"))
    extra_eos_token_ids: list[int] = field(
        default_factory=list, metadata=doc("more ids that end a request like eos_token_id")
    )
    tie_word_embeddings: bool = field(default=False, metadata=doc("share the embedding with the LM head"))
    attention_bias: bool = field(default=False, metadata=doc("qkv bias (Qwen2)"))
    qk_norm: bool = field(default=False, metadata=doc("per-head RMSNorm on q and k (Qwen3)"))
    conv_kernel: int = field(default=4, metadata=doc("hybrid only: width of the causal convolution state"))
    multimodal: bool = field(default=False, metadata=doc("the model takes non-text inputs"))
    path: str | None = field(
        default=None,
        metadata=doc(
            "a Hugging Face checkpoint directory, or a hub id (Qwen/Qwen3-0.6B) found in the "
            "Hugging Face cache or downloaded; null: random weights"
        ),
    )
    rope_scaling: dict[str, Any] = field(
        default_factory=dict, metadata=doc("config.json's rope_scaling (rope_type, factor, ...); {}: plain RoPE")
    )
    generation_config: bool = field(
        default=True,
        metadata=doc("take the checkpoint's generation_config.json sampling values as model.sampling_defaults "
                     "(vLLM's --generation-config auto); false: none (vLLM's --generation-config vllm)"),
    )
    sampling_defaults: dict[str, Any] = field(
        default_factory=dict,
        metadata=doc("what a request that leaves them out samples with (temperature, top_p, top_k, min_p, "
                     "repetition_penalty, max_tokens), over generation_config.json's (vLLM's "
                     "--override-generation-config)"),
    )


@dataclass
class ShmConfig:
    """``engine.shm``: the shared-memory ring between scheduler and workers."""

    materialization: Materialization = field(
        default=Materialization.auto,
        metadata=doc(
            "who issues the H2D of an SHM frame: early (the "
            "polling thread), ordered (the prepare stream), "
            "auto (its gate decides)"
        ),
    )
    num_slots: int = field(default=4, metadata=doc("frames in the ring"))
    slot_bytes: int = field(default=1 << 20, metadata=doc("bytes per frame, header included"))
    register_host: bool = field(default=False, metadata=doc("pin the SHM region in place (shows the race on real DMA)"))
    overlap: Mode = field(
        default=Mode.auto,
        metadata=doc("where the device is the host's CPU: the scheduler packs and ships step N+1 while the worker "
                     "computes step N, up to engine.run_ahead steps ahead (auto: its gate decides)"),
    )
    payload_crc: bool = field(
        default=False,
        metadata=doc("the CRC-32C of each frame covers its payload too, not only its header and the payload's "
                     "length (a pass over every step's inputs on both ends: for chaos and fault runs)"),
    )
    spin_us: float = field(
        default=2000.0,
        metadata=doc("microseconds a waiting end re-checks the ring (yielding the GIL) before it sleeps on its "
                     "eventfd, at most 150 where the host computes the step (the device is the host, or emulated); "
                     "0: sleep at once"),
    )


@dataclass
class EngineConfig:
    """``engine/<name>.yaml``: optimizations, transport, KV cache and batching."""

    graph: Mode = field(default=Mode.auto, metadata=doc("capture decode steps as device graphs"))
    async_token_handoff: Mode = field(
        default=Mode.auto, metadata=doc("overlap step N+1 on the device with the host's work on step N")
    )
    run_ahead: int | None = field(
        default=None, metadata=doc("with async handoff: steps the scheduler submits beyond the one it reads (1 or 2; "
                                   "null: 2 where steps cross to a worker that runs a device, 1 otherwise)")
    )
    structured_overlap: Mode = field(
        default=Mode.auto,
        metadata=doc("with async handoff: a structured-output step queues its forward ahead, its sampling waits for "
                     "the grammar's mask"),
    )
    fused_ops: Mode = field(
        default=Mode.auto, metadata=doc("run the backend's fused kernels in place of the reference ops")
    )
    pdl: Mode = field(
        default=Mode.auto,
        metadata=doc("launch the fused projection kernels with programmatic dependent launch in the graphs"),
    )
    transport: Transport = field(
        default=Transport.inproc,
        metadata=doc("inproc, or shm: the model runs in worker processes fed through shared memory"),
    )
    shm: ShmConfig = field(
        default_factory=ShmConfig, metadata=doc("the shared-memory ring between scheduler and workers")
    )
    kv_cache: str = field(default="paged", metadata=doc("KV cache layout; paged is the only one implemented"))
    block_size: int = field(default=16, metadata=doc("tokens per KV block"))
    num_kv_blocks: int = field(
        default=0,
        metadata=doc("KV blocks in the pool; 0: sized from memory (gpu_memory_utilization), on a device that is the "
                     "host or emulated at most what max_num_seqs requests of max_model_len need"),
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=doc("share of the device's memory (the host's for the cpu backend and the emulator) the engine may "
                     "use: weights, the largest step's activations, graphs, and the KV pool in what is left; (0, 1]"),
    )
    max_num_seqs: int = field(default=64, metadata=doc("most requests decoding at once"))
    max_num_batched_tokens: int = field(
        default=2048, metadata=doc("tokens one step feeds at most: its decode rows and prompt chunks")
    )
    chunked_prefill: Mode = field(
        default=Mode.auto, metadata=doc("feed prompts in chunks under max_num_batched_tokens, beside decode rows")
    )
    prefix_caching: Mode = field(default=Mode.auto, metadata=doc("share the KV blocks of prompts that begin alike"))
    graph_batch_sizes: list[int] = field(
        default_factory=lambda: [1, 2, 4, 8, 16, 32, 64],
        metadata=doc("decode batch buckets captured as graphs; one past max_num_seqs stands for it"),
    )
    mixed_graphs: Mode = field(
        default=Mode.auto,
        metadata=doc("steps that carry prompt tokens replay a graph captured per token bucket (graph_token_sizes)"),
    )
    graph_token_sizes: list[int] = field(
        default_factory=list,
        metadata=doc("token buckets captured for steps with prompt tokens; []: 16 to 256 by 16, by 32 to 512, by 64 "
                     "to 1024, by 256 to 4096, then by 512, up to max_num_batched_tokens"),
    )
    graph_kv_sizes: list[int] = field(
        default_factory=lambda: [256],
        metadata=doc("context widths (tokens) of decode graphs captured beside the full width where the attention "
                     "reads only live blocks (the cuda backend): a step whose longest context fits replays the "
                     "narrowest that holds it, whose attention splits that width, not the full one, across its "
                     "programs; []: the full width only (elsewhere every power-of-two width is captured)"),
    )
    graph_capture: GraphCapture = field(
        default=GraphCapture.auto,
        metadata=doc("upfront: every bucket at start; lazy: each bucket the first time a step needs it; auto: lazy "
                     "on the stream emulator (where a capture runs the model on the CPU), upfront on hardware"),
    )
    compile: bool = field(
        default=False, metadata=doc("torch.compile the decode step (inside the graph where graphs are on)")
    )
    speculative_draft_model: str | None = field(
        default=None, metadata=doc("not implemented; the gates refuse async handoff with one")
    )
    kv_transfer_connector: str | None = field(
        default=None, metadata=doc("not implemented; the gates refuse async handoff with one")
    )
    tp: int = field(default=1, metadata=doc("tensor-parallel ranks (needs transport=shm)"))
    fast_allreduce: Mode = field(
        default=Mode.auto,
        metadata=doc(
            "tensor parallelism: small all-reduces through device symmetric memory (one kernel, "
            "inside the graphs) instead of the collective library"
        ),
    )
    timeout_s: float = field(
        default=60.0, metadata=doc("longest any wait may take before it fails naming what it waited for")
    )
    trace: bool = field(
        default=False,
        metadata=doc("write trace.json (Chrome/Perfetto) of host and device spans into the run directory"),
    )
    metrics_window: int = field(
        default=10_000, metadata=doc("latest requests and steps kept for percentiles; totals cover all")
    )
    refuse_overlong: bool = field(
        default=False,
        metadata=doc(
            "a request whose prompt + max_tokens exceeds model.max_model_len ends with "
            "finish_reason error; false: it is cut at max_model_len with a warning"
        ),
    )


@dataclass
class WorkloadConfig:
    """``workload/<name>.yaml``: the requests of a run, and when they arrive."""

    num_requests: int = field(default=16, metadata=doc("random requests in the run (not with prompts or dataset)"))
    prompt_len_min: int = field(
        default=8, metadata=doc("random prompts: fewest tokens (lengths drawn uniformly in [min, max])")
    )
    prompt_len_max: int = field(default=32, metadata=doc("random prompts: most tokens"))
    output_len_min: int = field(
        default=16, metadata=doc("random requests: smallest max_tokens (drawn uniformly in [min, max])")
    )
    output_len_max: int = field(
        default=32, metadata=doc("largest max_tokens; the max_tokens of prompts and of dataset lines without one")
    )
    temperature: float = field(default=0.0, metadata=doc("sampling temperature; 0: greedy"))
    top_k: int = field(default=0, metadata=doc("keep the k most likely tokens; 0: off"))
    top_p: float = field(default=1.0, metadata=doc("keep the most likely tokens up to this probability mass; 1: off"))
    seed: int = field(default=0, metadata=doc("seed of prompts, lengths, arrival times and per-request sampling"))
    ignore_eos: bool = field(default=False, metadata=doc("keep generating past the EOS token"))
    stop_token_ids: list[int] = field(default_factory=list, metadata=doc("extra token ids that end a request"))
    stop_string_fraction: float = field(
        default=0.0, metadata=doc("share of requests with host-side stop strings (synchronous steps)")
    )
    multimodal_fraction: float = field(
        default=0.0, metadata=doc("share of requests flagged multimodal (synchronous steps)")
    )
    prompts: list[str] = field(
        default_factory=list, metadata=doc("text prompts, one request each (needs model.path with tokenizer.json)")
    )
    dataset: str | None = field(
        default=None,
        metadata=doc(
            'a JSONL file, one request a line: {"prompt": TEXT} or {"prompt_token_ids": [IDS]}, optional "max_tokens"'
        ),
    )
    request_rate: float = field(
        default=0.0, metadata=doc("requests per second, arriving as a Poisson process; 0 or inf: all at once")
    )
    max_concurrency: int = field(
        default=0, metadata=doc("most requests in flight at once; later ones wait for one to finish; 0: no limit")
    )


@dataclass
class RequirementConfig:
    """One condition of a feature gate: ``fact op value``, and the sentence shown when it fails."""

    fact: str = field(default=MISSING, metadata=doc("capabilities.*, config.*, model.*, features.* or request.*"))
    reason: str = field(default=MISSING, metadata=doc("the sentence shown when the requirement fails"))
    op: Op = field(default=Op.eq, metadata=doc("how the fact is compared with value"))
    value: Any = field(default=True, metadata=doc("what the fact is compared with"))
    scope: Scope = field(
        default=Scope.start, metadata=doc("start: checked once; step: checked for every scheduled step")
    )
    auto_only: bool = field(default=False, metadata=doc("a benefit condition: auto needs it, on does not"))


@dataclass
class CombinationConfig:
    """How a feature works together with another gate (shown by plan, run by a test)."""

    feature: str = field(default="", metadata=doc("the other feature"))
    rule: str = field(default="", metadata=doc("what holds when both are on"))


@dataclass
class FeatureConfig:
    """``features/<name>.yaml``: one feature gate."""

    # Where the mode is set: another config key (``mode_key``, e.g. engine.graph), or ``mode``
    # right here, so a gate added as YAML alone is switched with features.<name>.mode=on.
    mode_key: str = field(default="", metadata=doc("config key holding the feature's mode; empty: use mode"))
    mode: Mode | None = field(default=None, metadata=doc("the mode of a gate without mode_key"))
    mode_map: dict[str, str] = field(default_factory=dict, metadata=doc("maps mode values to auto/on/off"))
    description: str = field(default="", metadata=doc("one line, shown by plan"))
    order: int = field(
        default=100, metadata=doc("the gate's row in plan (lower first); gates it depends on are decided first anyway")
    )
    requirements: list[RequirementConfig] = field(
        default_factory=list, metadata=doc("all must hold for auto to enable it; on refuses if any fails")
    )
    combines: list[CombinationConfig] = field(
        default_factory=list, metadata=doc("how the feature works with other gates, one rule each")
    )


@dataclass
class PluginsConfig:
    """``plugins``: which backend plugins may load."""

    allow: list[str] | None = field(
        default=None, metadata=doc("load only these plugins (also CORELIB_PLUGINS=a,b); null: all")
    )
    block: list[str] = field(
        default_factory=list, metadata=doc("never load these plugins (also CORELIB_BLOCK_PLUGINS=a,b)")
    )


@dataclass
class BenchConfig:
    """``bench/<name>.yaml``: the sweep of ``python -m corelib bench``."""

    batch_sizes: list[int] = field(default_factory=lambda: [1, 8], metadata=doc("decode batch sizes"))
    handoff: list[str] = field(
        default_factory=lambda: ["off", "on"], metadata=doc("async token handoff modes compared")
    )
    transport: list[str] = field(default_factory=lambda: ["inproc"], metadata=doc("inproc and/or shm"))
    materialization: list[str] = field(
        default_factory=lambda: ["auto"], metadata=doc("auto, early and/or ordered (shm only)")
    )
    fused_ops: list[str] = field(
        default_factory=lambda: ["auto"], metadata=doc("fused_ops modes compared (auto, on, off): fused vs reference")
    )
    pdl: list[str] = field(
        default_factory=lambda: ["auto"], metadata=doc("pdl modes compared (auto, on, off): PDL in the graphs or not")
    )
    backends: list[str] = field(default_factory=list, metadata=doc("backends to sweep; empty: the selected one"))
    tp: list[int] = field(
        default_factory=lambda: [1], metadata=doc("tensor-parallel ranks to sweep; tp > 1 always runs over shm")
    )
    fast_allreduce: list[str] = field(
        default_factory=lambda: ["auto"],
        metadata=doc("fast_allreduce modes compared at tp > 1 (auto, on, off): symmetric memory vs the collective "
                     "library, inside the graphs"),
    )
    prompt_len: int = field(default=32, metadata=doc("prompt tokens per request"))
    output_len: int = field(default=64, metadata=doc("new tokens per request"))
    temperature: float = field(
        default=0.0, metadata=doc("the decode points' temperature: 0 greedy; above 0 every request draws (seeded)"))
    top_p: float = field(default=1.0, metadata=doc("the decode points' top-p (1: no cut)"))
    warmup_steps: int = field(default=4, metadata=doc("steps run before timing"))
    repeats: int = field(default=1, metadata=doc("timed repetitions per point"))
    prompt_lens: list[int] = field(
        default_factory=list, metadata=doc("prompt lengths whose time to first token is measured; []: none"))
    prompt_counts: list[int] = field(
        default_factory=lambda: [1], metadata=doc("prompts sent at once for each of prompt_lens"))


@dataclass
class CorelibConfig:
    """The root of the composed config."""

    backend: BackendConfig = field(default=MISSING, metadata=doc("the device plugin and its runtime"))
    model: ModelConfig = field(default=MISSING, metadata=doc("the decoder and its weights"))
    engine: EngineConfig = field(default=MISSING, metadata=doc("optimizations, transport, KV cache and batching"))
    workload: WorkloadConfig = field(
        default=MISSING, metadata=doc("the requests of run (and of bench, where it says so)")
    )
    features: dict[str, FeatureConfig] = field(default_factory=dict, metadata=doc("the feature gates, as data"))
    plugins: PluginsConfig = field(default_factory=PluginsConfig, metadata=doc("which backend plugins may load"))
    bench: BenchConfig = field(default_factory=BenchConfig, metadata=doc("the sweep of bench"))
    server: ServerConfig = field(
        default_factory=lambda: ServerConfig(),  # noqa: PLW0108 - ServerConfig is defined below
        metadata=doc("the HTTP server of serve, and bench-serve's load"),
    )


_GATE_KEY = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)*")  # no double underscore: it joins the keys in class names
_gate_keys: dict[str, str] = {}  # engine keys that gate files declare -> their help


def declare_gate_keys(keys: Mapping[str, str]) -> None:
    """Make ``engine.<key>`` a mode (``auto`` by default) for each ``{key: help}`` the schema lacks; replaces
    the keys declared before. Takes effect at the next :func:`register_schemas`."""
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    for key in keys:
        if not _GATE_KEY.fullmatch(key):
            raise ValueError(f"engine.{key}: a gate's engine key is lowercase words joined by single underscores")
    _gate_keys.clear()
    _gate_keys.update({key: text for key, text in sorted(keys.items()) if key not in known})


def engine_schema() -> type[EngineConfig]:
    """The schema of ``engine``: :class:`EngineConfig` and the keys the gate files declare."""
    return _schemas(tuple(_gate_keys))[0]


def root_schema() -> type[CorelibConfig]:
    """The schema of the composed config: :class:`CorelibConfig` with :func:`engine_schema` as its engine."""
    return _schemas(tuple(_gate_keys))[1]


@functools.cache
def _schemas(keys: tuple[str, ...]) -> tuple[type[EngineConfig], type[CorelibConfig]]:
    if not keys:
        return EngineConfig, CorelibConfig
    name = "__".join(keys)
    helps = {key: _gate_keys.get(key) or "its feature gate's mode" for key in keys}
    engine = dataclasses.make_dataclass(
        f"EngineConfig__{name}",
        [(key, Mode, field(default=Mode.auto, metadata=doc(helps[key]))) for key in keys],
        bases=(EngineConfig,),
    )
    root = dataclasses.make_dataclass(
        f"CorelibConfig__{name}",
        [("engine", engine, field(default=MISSING, metadata=doc("optimizations, transport, KV cache and batching")))],
        bases=(CorelibConfig,),
    )
    for schema in (engine, root):
        schema.__module__ = __name__  # pickled configs (a worker's) find the class through __getattr__ below
    return engine, root


def __getattr__(name: str) -> type:
    """``EngineConfig__a__b`` and ``CorelibConfig__a__b``: the schemas with gate keys a and b, in any process."""
    for index, prefix in enumerate(("EngineConfig__", "CorelibConfig__")):
        if name.startswith(prefix):
            return _schemas(tuple(name[len(prefix):].split("__")))[index]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_schemas() -> None:
    """Store the schemas in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="corelib_schema", node=root_schema())


class LogLevel(str, enum.Enum):
    """uvicorn's log levels."""

    critical = "critical"
    error = "error"
    warning = "warning"
    info = "info"
    debug = "debug"
    trace = "trace"


class Endpoint(str, enum.Enum):
    """Which OpenAI route ``bench-serve`` loads."""

    completions = "completions"
    chat = "chat"


@dataclass
class ServeBenchConfig:
    """``server.bench``: the load ``python -m corelib bench-serve`` puts on a running server."""

    url: str = field(default="http://127.0.0.1:8000", metadata=doc("the server's base URL"))
    endpoint: Endpoint = field(
        default=Endpoint.completions, metadata=doc("completions or chat (chat needs a tokenizer)")
    )
    rates: list[float] = field(default_factory=list, metadata=doc("requests/s with Poisson arrivals, one point each"))
    concurrency: list[int] = field(
        default_factory=lambda: [8], metadata=doc("fixed numbers of clients, one point each")
    )
    num_requests: int = field(default=64, metadata=doc("requests per point (0: as many as duration_s allows)"))
    duration_s: float = field(default=0.0, metadata=doc("seconds per point (0: until num_requests are sent)"))
    dataset: str | None = field(
        default=None, metadata=doc('JSONL file with {"prompt": ...} per line; null: random token-id prompts')
    )
    prompt_len: int = field(default=32, metadata=doc("tokens of a random prompt (after the shared prefix)"))
    shared_prefix_len: int = field(
        default=0, metadata=doc("tokens every random prompt starts with, the same for all (a system prompt); 0: none")
    )
    output_len: int = field(default=64, metadata=doc("tokens asked of every request (EOS ignored)"))
    decoders: int = field(
        default=0,
        metadata=doc("mixed traffic: requests kept decoding while each point's load arrives; their inter-token "
                     "times are reported apart"),
    )
    decoder_prompt_len: int = field(default=32, metadata=doc("tokens of a decoder's random prompt"))
    decoder_output_len: int = field(
        default=1024, metadata=doc("tokens a decoder asks for; it asks again when done, until the point ends")
    )
    disconnect_fraction: float = field(default=0.0, metadata=doc("share of clients that hang up mid-stream"))
    temperature: float = field(
        default=0.0, metadata=doc("every request's temperature: 0 greedy; OpenAI's default, what clients send, is 1")
    )
    top_p: float = field(default=1.0, metadata=doc("every request's top-p (1: no cut)"))
    top_k: int = field(default=0, metadata=doc("every request's top-k (0 or -1: no cut)"))
    min_p: float = field(default=0.0, metadata=doc("every request's min-p (0: no cut)"))
    seed: int = field(default=0, metadata=doc("prompts, arrivals and disconnects"))
    timeout_s: float = field(default=300.0, metadata=doc("longest one request may take"))
    api_key: str | None = field(default=None, metadata=doc("sent as Authorization: Bearer"))
    model: str | None = field(default=None, metadata=doc("model name sent; null: the first of /v1/models"))
    settle_s: float = field(
        default=30.0, metadata=doc("after the load, how long to wait for the server to return to idle")
    )
    sample_s: float = field(
        default=10.0, metadata=doc("during the load, read the server's /metrics this often (0: never)")
    )


@dataclass
class ServerConfig:
    """``server/<name>.yaml``: the OpenAI-compatible HTTP server of ``python -m corelib serve``."""

    host: str = field(default="127.0.0.1", metadata=doc("interface to listen on (0.0.0.0: every interface)"))
    port: int = field(default=8000, metadata=doc("TCP port"))
    api_key: str | None = field(
        default=None, metadata=doc("when set, every /v1 request needs Authorization: Bearer KEY")
    )
    max_waiting: int = field(default=256, metadata=doc("requests accepted beyond engine.max_num_seqs; more get 429"))
    max_body_mib: float = field(default=1.0, metadata=doc("largest request body; a larger one gets 413 unread"))
    header_timeout_s: float = field(
        default=10.0, metadata=doc("a client must send its request's headers, and each part of its body, this fast")
    )
    max_connections: int = field(default=1024, metadata=doc("open connections at most; more are closed at once"))
    max_request_tokens: int = field(
        default=1 << 20, metadata=doc("prompt tokens of one request at most, all its prompts together; more get 400")
    )
    served_model_name: str | None = field(
        default=None, metadata=doc("name in /v1/models and responses; null: the model's name")
    )
    chat_template: str | None = field(
        default=None, metadata=doc("a Jinja chat template file; null: the checkpoint's, else a plain one")
    )
    shutdown_grace_s: float = field(
        default=10.0, metadata=doc("on SIGTERM, how long running requests may finish before they are aborted")
    )
    seed: int | None = field(
        default=None, metadata=doc("seeds the requests that send none, in the order they arrive (vLLM's --seed); "
                                   "null: each draws a fresh one")
    )
    log_level: LogLevel = field(default=LogLevel.info, metadata=doc("uvicorn's log level"))
    access_log: bool = field(default=False, metadata=doc("one log line per HTTP request"))
    bench: ServeBenchConfig = field(
        default_factory=ServeBenchConfig, metadata=doc("the load bench-serve puts on a running server")
    )


def checked_api_key(value: object) -> str | None:
    """The server's API key, or None for none; an empty one is a mistake, never "no authentication".

    ``CORELIB_API_KEY=$(cat key.txt)`` with the file missing sets the variable to an empty
    string: serving without a key then would be the opposite of what was asked.
    """
    if value is None:
        return None
    key = str(value)
    if not key.strip():
        raise ConfigError("server.api_key is set but empty (is CORELIB_API_KEY=''? a $(cat FILE) whose file is "
                          "missing gives that): set a key, or unset CORELIB_API_KEY to serve without one")
    if key != key.strip() or any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        raise ConfigError("server.api_key has spaces around it or control characters in it, which a client's "
                          "Authorization header cannot carry: set the key alone")
    return key
