"""Architectures by name: the built-in Llama family and the hybrid, and those plugins add.

An :class:`Architecture` says what the feature gates need to know without weights
(:meth:`facts`), which Hugging Face ``architectures`` names it loads, checks a config against
itself (:meth:`validate`), and builds a :class:`~corelib.models.base.Model` on a device
(:meth:`load`). A plugin adds one through the ``corelib_models`` hook; the engine never
names an architecture.

A member of the Llama family is one :class:`LlamaVariant` line in :data:`BUILTIN`: its flags
make the shape, the shape makes the weight map (:mod:`corelib.models.weight_map`), and the
weight map is all the loader, the shards and the random weights know of a checkpoint's tensors.
The line also states the variant's modeling (RoPE style, norm, biases, attention, activation):
the decoder computes one set of these (:data:`DECODER`), and a variant that declares anything
else is refused in one line when it is registered or first used, since the same weights would
otherwise run through the wrong math and give plausible but wrong tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from enum import Enum
from typing import TYPE_CHECKING, Protocol

import torch

from corelib.config.schema import ModelConfig
from corelib.errors import ConfigError
from corelib.models.base import Model, ModelFacts
from corelib.models.checkpoint import load_checkpoint
from corelib.models.hybrid import HybridModel
from corelib.models.llama import LlamaModel, ModelWeights, build_weights
from corelib.models.random_init import init_on_device, random_state_dict, seeded_weights
from corelib.models.rope import RopeScaling
from corelib.models.shape import ModelShape, torch_dtype
from corelib.models.sharding import TensorShard, check_divisible
from corelib.models.weight_map import weight_map

if TYPE_CHECKING:
    from corelib.platform.device import Device


class Architecture(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def hf_architectures(self) -> tuple[str, ...]:
        """config.json ``architectures`` entries this loads."""
        ...

    def facts(self, cfg: ModelConfig) -> ModelFacts: ...

    def validate(self, cfg: ModelConfig, tp: int) -> None:
        """Raise a ConfigError naming the key when ``cfg`` cannot run with ``tp`` ranks."""
        ...

    def load(self, cfg: ModelConfig, device: Device, shard: TensorShard | None, compile_decode: bool) -> Model:
        """The model with its weights (random, or ``cfg.path``) on ``device``; ``shard``: one rank's part."""
        ...


class Rope(Enum):
    """Which two dimensions of a head rotate together (the value is how a refusal names the style).

    The same checkpoint tensors give different q and k under the two, so a variant must say which
    its checkpoints were trained (or converted) for.
    """

    ROTATE_HALF = "rotate-half RoPE"  # dimension i with i + head_dim/2: transformers' rotate_half
    INTERLEAVED = "interleaved RoPE"  # dimensions 2i and 2i+1: GPT-J, Meta's original Llama and Mistral format


class Norm(Enum):
    """The norm before attention, before the MLP and at the end (and of q/k per head, where a variant has one)."""

    RMS_NORM = "RMSNorm"
    LAYER_NORM = "LayerNorm"  # mean-centred, with a bias (Cohere, StableLM)


class Attention(Enum):
    """Which positions a token attends to, and how its scores are formed."""

    CAUSAL = "full causal attention"  # every earlier position, scores q.k / sqrt(head_dim)
    SLIDING_WINDOW = "sliding-window attention"  # only the last W positions, in every layer
    LOCAL_GLOBAL = "alternating local and global attention layers"  # Gemma 2/3, Cohere 2
    CHUNKED = "chunked local attention"  # Llama 4
    SOFTCAPPED = "attention logit soft-capping"  # Gemma 2
    BIDIRECTIONAL = "bidirectional attention"


class Activation(Enum):
    """The activation of the gated MLP, down(act(gate(x)) * up(x))."""

    SILU = "the SiLU activation (SwiGLU)"
    GELU = "the GELU activation (GeGLU)"
    GELU_TANH = "the tanh-approximated GELU activation"
    RELU = "the ReLU activation"


@dataclass(frozen=True)
class Modeling:
    """What the decoder computes (:mod:`corelib.models.llama`, checked against :mod:`corelib.models.reference`).

    qkv biases and per-head q/k RMSNorm are flags of that code (Qwen2, Qwen3); everything here has
    one value the decoder computes.
    """

    rope: Rope = Rope.ROTATE_HALF
    norm: Norm = Norm.RMS_NORM
    attention: Attention = Attention.CAUSAL
    activation: Activation = Activation.SILU
    o_bias: bool = False
    mlp_bias: bool = False


DECODER = Modeling()
# the bias flags as a refusal says them: (set, unset)
_BIASES = {"o_bias": ("a bias on o_proj", "o_proj without a bias"),
           "mlp_bias": ("biases on the MLP projections", "the MLP without biases")}


def _said(field: str, value: object) -> str:
    if isinstance(value, Enum):
        return str(value.value)
    present, absent = _BIASES[field]
    return present if value else absent


@dataclass(frozen=True)
class LlamaVariant:
    """A member of the Llama family: its modeling, the flags its shape takes, and the model class that runs it.

    The modeling fields (those of :class:`Modeling`) default to the Llama baseline and say what
    the variant's checkpoints were trained with; :meth:`refusal` compares them with
    :data:`DECODER`, since a line that only named a new ``architectures`` entry would otherwise
    run the baseline's math on any weights. A checkpoint's config.json may still ask for more
    than its variant declares (a sliding window, soft-capping): ``corelib.models.hf_config``
    refuses that per checkpoint.
    """

    name: str
    hf_architectures: tuple[str, ...] = ()
    rope: Rope = Rope.ROTATE_HALF
    norm: Norm = Norm.RMS_NORM
    attention: Attention = Attention.CAUSAL
    activation: Activation = Activation.SILU
    attention_bias: bool = False  # q/k/v biases, none on o_proj (Qwen2)
    o_bias: bool = False  # a bias on o_proj (Llama's attention_bias=true puts one on q, k, v and o)
    mlp_bias: bool = False  # biases on gate, up and down
    qk_norm: bool = False  # per-head q/k RMSNorm before RoPE (Qwen3)
    conv_state: bool = False  # a causal-convolution state per sequence (the hybrid)
    fused_qkv: bool = False  # checkpoints hold q/k/v as one qkv_proj tensor (Phi-3)
    fused_gate_up: bool = False  # checkpoints hold gate/up as one gate_up_proj tensor (Phi-3)

    def refusal(self) -> str | None:
        """Why the decoder cannot run this variant as declared, as one line; None when it can."""
        differing = [f.name for f in fields(Modeling) if getattr(self, f.name) != getattr(DECODER, f.name)]
        if not differing:
            return None
        declared = " and ".join(_said(name, getattr(self, name)) for name in differing)
        computed = " and ".join(_said(name, getattr(DECODER, name)) for name in differing)
        return f"Llama-family variant {self.name!r} declares {declared}; the decoder computes {computed} only"

    def check(self) -> None:
        """Raise the :meth:`refusal` as a ConfigError, before anything runs the variant."""
        refusal = self.refusal()
        if refusal is not None:
            raise ConfigError(refusal)

    def facts(self, cfg: ModelConfig) -> ModelFacts:
        self.check()  # the startup asks for the facts first
        # The hybrid's convolution state is not checked under a padded step: its prompt steps run eagerly.
        return ModelFacts(self.name, recurrent_state=self.conv_state, multimodal=bool(cfg.multimodal),
                          ragged_graphs=not self.conv_state)

    def shape(self, cfg: ModelConfig) -> ModelShape:
        """The shape of ``cfg`` (resolved: a checkpoint's values in it) as this variant runs it."""
        self.check()  # validation, the weights and the loader all start from the shape
        if cfg.num_heads < 1 or cfg.num_kv_heads < 1:
            raise ConfigError(f"model.num_heads={cfg.num_heads} and model.num_kv_heads={cfg.num_kv_heads} "
                              "must be at least 1")
        if cfg.num_heads % cfg.num_kv_heads:
            raise ConfigError(
                f"model.num_heads={cfg.num_heads} is not a multiple of model.num_kv_heads={cfg.num_kv_heads}"
            )
        return ModelShape(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim or cfg.hidden_size // cfg.num_heads,
            intermediate_size=cfg.intermediate_size,
            max_model_len=cfg.max_model_len or cfg.max_position_embeddings,  # 0: resolved at startup, as here
            rope_theta=cfg.rope_theta,
            rms_norm_eps=cfg.rms_norm_eps,
            # "auto" (the checkpoint's dtype) is resolved at startup; random weights have none
            dtype=torch_dtype("float32" if cfg.dtype == "auto" else cfg.dtype),
            attention_bias=cfg.attention_bias or self.attention_bias,
            qk_norm=cfg.qk_norm or self.qk_norm,
            tie_word_embeddings=cfg.tie_word_embeddings,
            conv_kernel=cfg.conv_kernel if self.conv_state else 0,
            rope_scaling=RopeScaling.parse(cfg.rope_scaling, cfg.max_model_len or cfg.max_position_embeddings),
            fused_qkv=self.fused_qkv,
            fused_gate_up=self.fused_gate_up,
        )

    def validate(self, cfg: ModelConfig, tp: int) -> None:
        shape = self.shape(cfg)
        if tp > 1:
            check_divisible(shape, tp)

    def load(self, cfg: ModelConfig, device: Device, shard: TensorShard | None, compile_decode: bool) -> Model:
        weights = llama_weights(cfg, device.torch_device, shard)
        model_class = HybridModel if self.conv_state else LlamaModel
        return model_class(weights, self.facts(cfg), compile_decode=compile_decode)


# Each line states how its modeling differs from the Llama baseline (the field defaults); a new
# line is checked against transformers by tests/checkpoints/test_transformers_equivalence.py.
BUILTIN: tuple[LlamaVariant, ...] = (
    LlamaVariant("llama", ("LlamaForCausalLM",)),
    # Mistral's window: attention is full causal within it, and a config.json window shorter than
    # model.max_model_len is refused (corelib.models.hf_config)
    LlamaVariant("mistral", ("MistralForCausalLM",)),
    LlamaVariant("qwen2", ("Qwen2ForCausalLM",), attention_bias=True),
    LlamaVariant("qwen3", ("Qwen3ForCausalLM",), qk_norm=True),
    LlamaVariant("phi3", ("Phi3ForCausalLM",), fused_qkv=True, fused_gate_up=True),
    LlamaVariant("hybrid", conv_state=True),
)

_REGISTERED: dict[str, Architecture] = {variant.name: variant for variant in BUILTIN}


def register(architecture: Architecture, source: str) -> None:
    """Add an architecture (from a plugin's ``corelib_models`` hook); a name may be taken once.

    A Llama-family variant is refused here when it declares modeling the decoder does not compute.
    """
    if isinstance(architecture, LlamaVariant) and (refusal := architecture.refusal()) is not None:
        raise ConfigError(f"{source}: {refusal}")
    known = _REGISTERED.get(architecture.name)
    if known is not None and type(known) is not type(architecture):
        raise ConfigError(f"{source} registers model architecture {architecture.name!r}, which exists already")
    _REGISTERED[architecture.name] = architecture


def names() -> tuple[str, ...]:
    return tuple(_REGISTERED)


def llama_variants() -> tuple[LlamaVariant, ...]:
    """The registered members of the Llama family, the built-in ones first."""
    return tuple(entry for entry in _REGISTERED.values() if isinstance(entry, LlamaVariant))


def architecture(name: str) -> Architecture:
    found = _REGISTERED.get(name)
    if found is None:
        raise ConfigError(f"model.architecture={name}: not supported; supported: {', '.join(_REGISTERED)}")
    return found


def llama_variant(name: str) -> LlamaVariant:
    """The Llama-family member ``name`` (its shape flags); a ConfigError for other architectures."""
    found = architecture(name)
    if not isinstance(found, LlamaVariant):
        raise ConfigError(f"model.architecture={name} is not of the Llama family")
    return found


def model_shape(cfg: ModelConfig) -> ModelShape:
    """The shape of a Llama-family ``cfg`` (resolved), as its variant runs it."""
    return llama_variant(cfg.architecture).shape(cfg)


def hf_architecture(hf_names: list[str]) -> str | None:
    """The registered architecture that loads one of config.json's ``architectures``, if any."""
    for hf_name in hf_names:
        for entry in _REGISTERED.values():
            if hf_name in entry.hf_architectures:
                return entry.name
    return None


def hf_architecture_names() -> list[str]:
    return [hf for entry in _REGISTERED.values() for hf in entry.hf_architectures]


def model_facts(cfg: ModelConfig) -> dict[str, bool | str]:
    """Facts for ``model.*`` requirements: paged KV, device-side decode inputs, recurrent state."""
    return architecture(cfg.architecture).facts(cfg).as_dict()


def llama_weights(cfg: ModelConfig, device: torch.device, shard: TensorShard | None = None) -> ModelWeights:
    """Random seeded weights, or a checkpoint when ``model.path`` is set; ``shard``: one rank's part.

    ``cfg`` is resolved (``corelib.models.hf_config``; the startup does it). Random weights come
    from the CPU path or are drawn on the device, as ``model.init`` says
    (``corelib.models.random_init``); either way every rank starts from the same full tensors.
    """
    shape = model_shape(cfg)
    if cfg.path:
        return _sharded(load_checkpoint(cfg, shape, device, shard), shard)
    if init_on_device(cfg, shape):
        return _sharded(seeded_weights(shape, cfg.seed, device, shard), shard)
    # The full model, identical on every rank; copied, since the host copy is cached for the
    # next engine and this one's weights may be changed in place.
    state = _random_state(shape, cfg.seed)
    if shard is None:
        return build_weights(shape, state, device, copy=True)
    sources = weight_map(shape).sources
    local = {name: shard.slice(sources[name], tensor) for name, tensor in state.items()}
    return _sharded(build_weights(shard.shape(shape), local, device, copy=True), shard)


def _sharded(weights: ModelWeights, shard: TensorShard | None) -> ModelWeights:
    """One rank's model: its all-reduce, and its block of the LM head (vocabulary-parallel)."""
    if shard is None:
        return weights
    weights.all_reduce = shard.all_reduce
    if shard.world > 1:
        vocab = shard.vocab(weights.shape.vocab_size)
        weights.lm_head = vocab.rows(weights.lm_head)  # a tied embedding stays whole: the lookup needs it
        weights.vocab = vocab
    return weights


@functools.lru_cache(maxsize=1)
def _random_state(shape: ModelShape, seed: int) -> dict[str, torch.Tensor]:
    # Engines built one after another in a process (bench, tests) reuse the host copy.
    return random_state_dict(shape, seed)
