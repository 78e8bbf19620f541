"""A Hugging Face ``config.json`` as corelib ``model.*`` values.

Precedence, when ``model.path`` is set: the checkpoint describes the network, the config
describes how to run it. Everything that fixes the weights' shapes or the math (architecture,
sizes, head_dim, RoPE base and scaling, norm epsilon, tied embeddings, qkv bias, q/k norm)
and the EOS ids come from ``config.json`` and replace the preset's values. ``model.dtype``
stays the user's choice (``auto`` takes the checkpoint's on an accelerator, float32 where the
device is the host: the startup decides), and ``model.max_model_len`` too, capped at the
checkpoint's ``max_position_embeddings`` (0, the default, takes it). ``generation_config.json``'s
sampling values go into ``model.sampling_defaults`` (whose own entries win; with
``model.generation_config=false`` none do): what a request that leaves a value out samples with,
as in vLLM.

A config that asks for math this decoder does not do (a sliding window that reaches inside
``model.max_model_len``, logit soft-capping, other attention scales, layers without RoPE,
mixtures of experts, ...) is refused in one line naming the key, rather than run with plain
attention and wrong tokens: :data:`UNSUPPORTED` lists them.

The startup resolves this once into the composed config, so the feature gates, the
scheduler, the workload and the loader all see the same effective values.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from corelib.config.schema import ModelConfig
from corelib.errors import ConfigError
from corelib.models import registry
from corelib.models.rope import RopeScaling
from corelib.models.shape import DTYPES
from corelib.trust.files import read_json
from corelib.trust.hub import checkpoint_directory, resolve_model_path

NO_EOS = -1  # eos_token_id when the checkpoint names none: no token id is negative
MAX_EOS_IDS = 1024  # end-of-sequence ids a checkpoint may name (real ones name one to a dozen)
# config.json's booleans that corelib reads: each must be a JSON true or false (or absent)
BOOL_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "use_qk_norm")
_NONE = object()
_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class CheckpointConfig:
    """What ``config.json`` (and ``generation_config.json``) say, as model.* values."""

    directory: Path
    hf_architecture: str
    fields: Mapping[str, Any]  # ModelConfig field -> value
    max_position_embeddings: int
    dtype: str  # the weights' dtype as config.json names it
    sliding_window: SlidingWindow | None = None
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)  # generation_config.json's, as request fields

    def apply(self, cfg: ModelConfig) -> tuple[ModelConfig, list[str]]:
        """``cfg`` with the checkpoint's values, and a note when max_model_len had to be capped."""
        notes = []
        max_len = cfg.max_model_len or self.max_position_embeddings
        if max_len > self.max_position_embeddings:
            notes.append(
                f"model.max_model_len={max_len} exceeds the checkpoint's max_position_embeddings="
                f"{self.max_position_embeddings}; using {self.max_position_embeddings}"
            )
            max_len = self.max_position_embeddings
        window = self.sliding_window
        if window is not None and max_len > window.size:
            raise ConfigError(
                f"{self.directory / 'config.json'}: {window.source}: sliding-window attention is not supported, "
                f"and the window is shorter than model.max_model_len={max_len}; set model.max_model_len<="
                f"{window.size} (within the window attention is full) or use another checkpoint"
            )
        dtype = self.dtype if cfg.dtype == "auto" else cfg.dtype
        path = str(self.directory)
        sampling = {**(self.sampling_defaults if cfg.generation_config else {}), **cfg.sampling_defaults}
        return replace(cfg, **self.fields, max_model_len=max_len, dtype=dtype, path=path,
                       sampling_defaults=sampling), notes

    def describe(self, cfg: ModelConfig) -> str:
        weights = self.dtype if cfg.dtype == self.dtype else f"{self.dtype} as {cfg.dtype}"
        return (
            f"model.path={self.directory}: {self.hf_architecture} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
            f"{cfg.num_heads}/{cfg.num_kv_heads} q/kv heads, vocab {cfg.vocab_size}), {weights}, "
            f"max_model_len {cfg.max_model_len}"
        )


def _read_json(path: Path) -> dict[str, Any]:
    data = read_json(path, "the checkpoint's settings")  # a regular file, bounded in size and depth
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


@dataclass(frozen=True)
class SlidingWindow:
    """The attention window a config sets: each token sees only the last ``size`` positions."""

    size: int
    source: str  # the keys that set it, as config.json has them


def sliding_window(hf: Mapping[str, Any]) -> SlidingWindow | None:
    """The window the config applies, if any.

    Mistral sets only ``sliding_window``; Qwen2 sets it too but applies it only with
    ``use_sliding_window: true``; ``layer_types`` may name ``sliding_attention`` layers.
    """
    size = hf.get("sliding_window")
    flag = hf.get("use_sliding_window")
    sliding_layers = "sliding_attention" in (hf.get("layer_types") or [])
    if size is None or (flag is False and not sliding_layers):
        return None
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ConfigError(f"config.json: sliding_window must be a positive integer or null (got {size!r})")
    source = f"sliding_window={size}" + (" with use_sliding_window=true" if flag else "")
    return SlidingWindow(size, source + (" (layer_types: sliding_attention)" if sliding_layers else ""))


def read_checkpoint_config(path: str) -> CheckpointConfig:
    """Parse and check ``config.json``; a ConfigError names what is missing or unsupported."""
    directory = checkpoint_directory(path)
    config_file = directory / "config.json"
    if not os.path.lexists(config_file):  # anything else there (a FIFO) is read, and refused, as it is
        raise ConfigError(
            f"model.path={path} has no config.json; expected a Hugging Face checkpoint directory "
            "with config.json and *.safetensors"
        )
    hf = _read_json(config_file)
    for key in BOOL_KEYS:
        _flag(hf, key, config_file)
    architecture = _architecture(hf, config_file)
    _refuse_unsupported(hf, architecture, config_file)

    def need(key: str) -> int:
        value = hf.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{config_file}: {key} must be a positive integer (got {value!r})")
        return value

    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    vocab = need("vocab_size")
    rope = _rope_parameters(hf)
    eos = _eos_ids(hf, directory / "generation_config.json", vocab)
    sampling = sampling_defaults(directory / "generation_config.json")
    max_positions = need("max_position_embeddings")
    rope_source = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    if rope.get("rope_type") in ("llama3", "yarn", "dynamic"):
        rope.setdefault("original_max_position_embeddings", max_positions)
        original = rope["original_max_position_embeddings"]
        usable = isinstance(original, int) and not isinstance(original, bool) and original > 0
        if rope.get("factor") is None and rope["rope_type"] == "yarn" and usable:
            rope["factor"] = max_positions / original  # a bad original is refused, by name, below
    def optional(key: str) -> int | None:
        return need(key) if hf.get(key) is not None else None

    def positive(key: str, value: Any) -> float:
        # json reads NaN and Infinity; either would reach the norm or RoPE and make every token 0
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{config_file}: {key} must be a finite number > 0 (got {value!r})")
        return float(value)

    theta_key = f"{rope_source}.rope_theta" if "rope_theta" in rope else "rope_theta"
    theta = rope.pop("rope_theta", hf.get("rope_theta"))
    arch = registry.hf_architecture([architecture]) or architecture
    variant = _llama_variant(arch)
    if variant is not None:  # each value where the RoPE formulas stay finite, named as config.json writes it
        RopeScaling.from_entry(rope, f"{config_file}: {rope_source}")  # (rope_theta, popped above, is checked too)
    fields: dict[str, Any] = {
        "architecture": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_layers": need("num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": optional("num_key_value_heads") or heads,
        "head_dim": optional("head_dim") or hidden // heads,
        "intermediate_size": need("intermediate_size"),
        "rope_theta": _DEFAULT_ROPE_THETA if theta is None else positive(theta_key, theta),
        "rms_norm_eps": positive("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": _flag(hf, "tie_word_embeddings", config_file),
        "attention_bias": variant is not None and variant.attention_bias,
        "qk_norm": variant is not None and variant.qk_norm,
        "eos_token_id": eos[0] if eos else NO_EOS,
        "extra_eos_token_ids": eos[1:],
        "rope_scaling": {} if rope.get("rope_type", "default") == "default" else rope,
        "multimodal": False,
        "max_position_embeddings": max_positions,
    }
    dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
    if dtype not in DTYPES:
        raise ConfigError(f"{config_file}: torch_dtype={dtype} is not a dtype corelib loads ({', '.join(DTYPES)})")
    return CheckpointConfig(directory, architecture, fields, max_positions, dtype, sliding_window(hf), sampling)


#: generation_config.json's keys that are sampling defaults, and the request field each becomes (vLLM's set)
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(generation_file: Path) -> dict[str, Any]:
    """The sampling values ``generation_config.json`` sets, under their request field names; {} without the file.

    A value of the wrong type is refused in one line naming the file and the key; its range is checked
    where it becomes a request's value (:class:`corelib.sampling_params.SamplingParams`), at startup.
    """
    if not generation_file.exists():
        return {}
    generation = _read_json(generation_file)
    found: dict[str, Any] = {}
    for key, name in GENERATION_DEFAULTS.items():
        value = generation.get(key)
        if value is None:
            continue
        integer = name in ("top_k", "max_tokens")
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            raise ConfigError(f"{generation_file}: {key} must be {'an integer' if integer else 'a number'} "
                              f"(got {json.dumps(value)[:40]})")
        found[name] = value if integer else float(value)
    return found


def _flag(hf: Mapping[str, Any], key: str, config_file: Path) -> bool:
    # JSON has true and false; the string "false" would otherwise count as true.
    value = hf.get(key)
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"{config_file}: {key} must be true or false (got {json.dumps(value)[:40]})")
    return bool(value)


def _llama_variant(name: str) -> registry.LlamaVariant | None:
    """The Llama-family variant registered as ``name``; None for a plugin's architecture."""
    found = registry.architecture(name) if name in registry.names() else None
    return found if isinstance(found, registry.LlamaVariant) else None


def _architecture(hf: Mapping[str, Any], config_file: Path) -> str:
    """The first of config.json's ``architectures`` that a registered architecture loads."""
    names = hf.get("architectures") or []
    supported = ", ".join(registry.hf_architecture_names())
    if not isinstance(names, list) or not names:
        raise ConfigError(f"{config_file} names no architectures; supported: {supported}")
    for name in names:
        if registry.hf_architecture([str(name)]) is not None:
            return str(name)
    raise ConfigError(f"{config_file}: architectures={names} is not supported; supported: {supported}")


@dataclass(frozen=True)
class Unsupported:
    """A config.json key whose values other than ``neutral`` ask for math this decoder does not do."""

    key: str
    neutral: tuple[object, ...]
    what: str  # what the key asks for, as the refusal says it


UNSUPPORTED: tuple[Unsupported, ...] = (
    Unsupported("hidden_act", (None, "silu"), "an activation other than silu"),
    Unsupported("mlp_bias", (None, False), "biases on the MLP projections"),
    Unsupported("partial_rotary_factor", (None, 1, 1.0), "RoPE on part of each head"),
    Unsupported("rotary_pct", (None, 1, 1.0), "RoPE on part of each head"),
    Unsupported("rope_interleave", (None, False), "interleaved RoPE (the decoder rotates halves)"),
    Unsupported("use_bidirectional_attention", (None, False), "bidirectional attention"),
    Unsupported("qk_layernorm", (None, False), "a q/k LayerNorm"),
    Unsupported("use_bias", (None, False), "biases on every projection"),
    Unsupported("attn_logit_softcapping", (None,), "attention logit soft-capping"),
    Unsupported("final_logit_softcapping", (None,), "final logit soft-capping"),
    Unsupported("query_pre_attn_scalar", (None,), "an attention scale other than 1/sqrt(head_dim)"),
    # Granite's attention_multiplier is the scale itself (its default 1.0 is not 1/sqrt(head_dim))
    Unsupported("attention_multiplier", (None,), "an attention scale other than 1/sqrt(head_dim)"),
    Unsupported("embedding_multiplier", (None, 1, 1.0), "scaled embeddings"),
    Unsupported("residual_multiplier", (None, 1, 1.0), "a scaled residual stream"),
    Unsupported("logits_scaling", (None, 1, 1.0), "scaled logits"),
    Unsupported("attention_chunk_size", (None,), "chunked local attention"),
    Unsupported("sliding_window_pattern", (None,), "alternating local and global attention layers"),
    Unsupported("no_rope_layers", (None, []), "layers without RoPE"),
    Unsupported("use_qk_norm", (None, False), "a weightless q/k norm"),
    Unsupported("num_local_experts", (None, 0, 1), "mixture-of-experts layers"),
    Unsupported("num_experts", (None, 0, 1), "mixture-of-experts layers"),
)
_LAYER_TYPES = ("full_attention", "sliding_attention")  # the second only within the window (CheckpointConfig.apply)


def _refuse_unsupported(hf: Mapping[str, Any], architecture: str, config_file: Path) -> None:
    """Options this decoder does not compute: refuse rather than mis-compute (one line names them all)."""
    problems = []
    quantization = hf.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        problems.append(f"quantization_config (quant_method={method}): quantized checkpoints are not supported")
    variant = _llama_variant(registry.hf_architecture([architecture]) or "")
    if variant is not None and not variant.attention_bias and hf.get("attention_bias"):
        problems.append("attention_bias=true: biases on the attention projections are not supported")
    for option in UNSUPPORTED:
        value = hf.get(option.key)
        if value in option.neutral or (option.key == "no_rope_layers" and isinstance(value, list) and all(value)):
            continue  # (SmolLM3 writes no_rope_layers with a 1 for every layer that has RoPE)
        problems.append(f"{option.key}={json.dumps(value)}: {option.what} is not supported")
    layer_types = hf.get("layer_types") or []
    unknown = sorted({str(kind) for kind in layer_types if kind not in _LAYER_TYPES})
    if unknown:
        problems.append(f"layer_types has {', '.join(unknown)}: only full_attention layers (and sliding_attention "
                        "within the window) are supported")
    if problems:
        raise ConfigError(f"{config_file} ({architecture}): {'; '.join(problems)}")


def _rope_parameters(hf: Mapping[str, Any]) -> dict[str, Any]:
    # transformers < 5 writes rope_theta and rope_scaling; 5 writes rope_parameters (theta included).
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"config.json: rope_scaling must be an object (got {rope!r})")
    rope = dict(rope)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    return rope


def _eos_ids(hf: Mapping[str, Any], generation_file: Path, vocab_size: int) -> list[int]:
    """config.json's EOS ids, then generation_config.json's (chat models list their end-of-turn there).

    Each must be a token id of the vocabulary (checked before anything else is done with the list), and
    there are at most :data:`MAX_EOS_IDS` of them once repeats are dropped.
    """
    sources = [("config.json", hf.get("eos_token_id"))]
    if generation_file.exists():
        sources.append((generation_file.name, _read_json(generation_file).get("eos_token_id")))
    ids: dict[int, None] = {}  # ordered, and a repeat costs nothing
    for name, value in sources:
        tokens = value if isinstance(value, list) else [value]
        bad = next((t for t in tokens if t is not None and not (isinstance(t, int) and not isinstance(t, bool)
                                                                 and 0 <= t < vocab_size)), _NONE)
        if bad is not _NONE:
            raise ConfigError(f"{generation_file.parent / name}: eos_token_id {json.dumps(bad)[:40]} is not a token id "
                              f"of the vocabulary [0, {vocab_size})")
        ids.update(dict.fromkeys(t for t in tokens if t is not None))
        if len(ids) > MAX_EOS_IDS:
            raise ConfigError(f"{generation_file.parent / name}: eos_token_id lists more than {MAX_EOS_IDS} distinct "
                              "token ids; a model ends its answers with a few")
    return list(ids)


def resolved_model_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with its checkpoint's values when ``model.path`` is set. Idempotent."""
    if not cfg.path:
        return replace(cfg, dtype="float32" if cfg.dtype == "auto" else cfg.dtype,
                       max_model_len=cfg.max_model_len or cfg.max_position_embeddings)
    return read_checkpoint_config(cfg.path).apply(cfg)[0]


def resolve_checkpoint(raw: DictConfig, device_is_host: bool = False) -> list[str]:
    """The startup hook: write the checkpoint's values into ``raw.model``; returns lines for the user.

    ``model.dtype=auto`` becomes the checkpoint's dtype on an accelerator (vLLM's ``auto``) and
    float32 where the device is the host (``device_is_host``: a CPU computes bfloat16 slowly, and
    float32 everywhere), or without a checkpoint; ``model.max_model_len=0`` becomes
    ``max_position_embeddings``. Each choice that was the default's is said, with why.
    """
    model = raw.model
    path = model.get("path")
    auto = model.get("dtype") == "auto"
    context = int(model.get("max_model_len") or 0)
    if not path:
        if auto:
            model.dtype = "float32"  # random weights: the dtype every device computes
        if not context:
            model.max_model_len = int(model.max_position_embeddings)
        return []
    checkpoint = read_checkpoint_config(resolve_model_path(str(path)))  # a hub id becomes its cached snapshot
    dtype = "float32" if auto and device_is_host else str(model.dtype)
    generation = bool(model.get("generation_config", True))
    current = ModelConfig(name=str(model.name), max_model_len=context, dtype=dtype, generation_config=generation,
                          sampling_defaults=dict(model.get("sampling_defaults") or {}))
    resolved, notes = checkpoint.apply(current)
    for key in (*checkpoint.fields, "max_model_len", "dtype", "path", "sampling_defaults"):
        model[key] = getattr(resolved, key)
    lines = [checkpoint.describe(resolved)]
    if auto:
        why = ("float32, as the device is the host's CPU (set model.dtype to choose)" if device_is_host else
               f"{resolved.dtype}, the checkpoint's (config.json torch_dtype), on an accelerator")
        lines.append(f"model.dtype=auto: {why}")
    if not context:
        lines.append(f"model.max_model_len={resolved.max_model_len}: the checkpoint's max_position_embeddings="
                     f"{checkpoint.max_position_embeddings}")
    if checkpoint.sampling_defaults and generation:
        values = ", ".join(f"{k}={v}" for k, v in checkpoint.sampling_defaults.items())
        lines.append(f"sampling defaults from generation_config.json: {values} (a request that sets one wins; "
                     "model.generation_config=false drops them)")
    return [*lines, *notes]
