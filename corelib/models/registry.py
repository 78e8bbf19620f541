"""Architectures by name: the built-in Llama family and the hybrid, and those plugins add.

An :class:`Architecture` says what the feature gates need to know without weights
(:meth:`facts`), which Hugging Face ``architectures`` names it loads, checks a config against
itself (:meth:`validate`), and builds a :class:`~corelib.models.base.Model` on a device
(:meth:`load`). A plugin adds one through the ``corelib_models`` hook; the engine never
names an architecture.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from corelib.config import ModelConfig
from corelib.errors import ConfigError
from corelib.models.base import Model, ModelFacts

if TYPE_CHECKING:
    from corelib.device import Device
    from corelib.models.llama import ModelShape, ModelWeights
    from corelib.models.sharding import TensorShard


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


@dataclass(frozen=True)
class LlamaVariant:
    """A member of the Llama family: the flags its shape takes, and the model class that runs it."""

    name: str
    hf_architectures: tuple[str, ...] = ()
    attention_bias: bool = False  # qkv bias (Qwen2)
    qk_norm: bool = False  # per-head q/k RMSNorm (Qwen3)
    conv_state: bool = False  # a causal-convolution state per sequence (the hybrid)

    def facts(self, cfg: ModelConfig) -> ModelFacts:
        return ModelFacts(self.name, recurrent_state=self.conv_state, multimodal=bool(cfg.multimodal))

    def validate(self, cfg: ModelConfig, tp: int) -> None:
        from corelib.models.llama import ModelShape
        from corelib.models.sharding import check_divisible

        shape = ModelShape.from_config(cfg)
        if tp > 1:
            check_divisible(shape, tp)

    def load(self, cfg: ModelConfig, device: Device, shard: TensorShard | None, compile_decode: bool) -> Model:
        from corelib.models.hybrid import HybridModel
        from corelib.models.llama import LlamaModel

        weights = llama_weights(cfg, device.torch_device, shard)
        model_class = HybridModel if self.conv_state else LlamaModel
        return model_class(weights, self.facts(cfg), compile_decode=compile_decode)


BUILTIN: tuple[LlamaVariant, ...] = (
    LlamaVariant("llama", ("LlamaForCausalLM",)),
    LlamaVariant("qwen2", ("Qwen2ForCausalLM",), attention_bias=True),
    LlamaVariant("qwen3", ("Qwen3ForCausalLM",), qk_norm=True),
    LlamaVariant("hybrid", conv_state=True),
)

_REGISTERED: dict[str, Architecture] = {variant.name: variant for variant in BUILTIN}


def register(architecture: Architecture, source: str) -> None:
    """Add an architecture (from a plugin's ``corelib_models`` hook); a name may be taken once."""
    known = _REGISTERED.get(architecture.name)
    if known is not None and type(known) is not type(architecture):
        raise ConfigError(f"{source} registers model architecture {architecture.name!r}, which exists already")
    _REGISTERED[architecture.name] = architecture


def names() -> tuple[str, ...]:
    return tuple(_REGISTERED)


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

    Random weights come from the CPU path or are drawn on the device, as ``model.init`` says
    (``corelib.models.random_init``); either way every rank starts from the same full tensors.
    """
    from corelib.models.llama import ModelShape, build_weights
    from corelib.models.random_init import init_on_device, seeded_weights

    if cfg.path:
        from corelib.models.checkpoint import load_checkpoint

        weights = load_checkpoint(cfg, device, shard)
        weights.all_reduce = shard.all_reduce if shard is not None else None
        return weights
    shape = ModelShape.from_config(cfg)
    if init_on_device(cfg, shape):
        weights = seeded_weights(shape, cfg.seed, device, shard)
        weights.all_reduce = shard.all_reduce if shard is not None else None
        return weights
    # The full model, identical on every rank; copied, since the host copy is cached for the
    # next engine and this one's weights may be changed in place.
    state = _random_state(shape, cfg.seed)
    if shard is None:
        return build_weights(shape, state, device, copy=True)
    local = {name: shard.slice(name, tensor) for name, tensor in state.items()}
    weights = build_weights(shard.shape(shape), local, device, copy=True)
    weights.all_reduce = shard.all_reduce
    return weights


@functools.lru_cache(maxsize=1)
def _random_state(shape: ModelShape, seed: int) -> dict[str, torch.Tensor]:
    # Engines built one after another in a process (bench, tests) reuse the host copy.
    from corelib.models.llama import random_state_dict

    return random_state_dict(shape, seed)
