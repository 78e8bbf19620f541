"""A Hugging Face ``config.json`` as corelib ``model.*`` values.

Precedence, when ``model.path`` is set: the checkpoint describes the network, the config
describes how to run it. Everything that fixes the weights' shapes or the math (architecture,
sizes, head_dim, RoPE base and scaling, norm epsilon, tied embeddings, qkv bias, q/k norm)
and the EOS ids come from ``config.json`` and replace the preset's values. ``model.dtype``
stays the user's choice (``auto`` takes the checkpoint's), and ``model.max_model_len`` too,
capped at the checkpoint's ``max_position_embeddings``.

The startup resolves this once into the composed config, so the feature gates, the
scheduler, the workload and the loader all see the same effective values.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from corelib.config import ModelConfig
from corelib.errors import ConfigError
from corelib.models import registry
from corelib.models.hub import resolve_model_path
from corelib.models.llama import DTYPES

NO_EOS = -1  # eos_token_id when the checkpoint names none: no token id is negative
_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class CheckpointConfig:
    """What ``config.json`` (and ``generation_config.json``) say, as model.* values."""

    directory: Path
    hf_architecture: str
    fields: Mapping[str, Any]  # ModelConfig field -> value
    max_position_embeddings: int
    dtype: str  # the weights' dtype as config.json names it

    def apply(self, cfg: ModelConfig) -> tuple[ModelConfig, list[str]]:
        """``cfg`` with the checkpoint's values, and a note when max_model_len had to be capped."""
        notes = []
        max_len = cfg.max_model_len
        if max_len > self.max_position_embeddings:
            notes.append(
                f"model.max_model_len={max_len} exceeds the checkpoint's max_position_embeddings="
                f"{self.max_position_embeddings}; using {self.max_position_embeddings}"
            )
            max_len = self.max_position_embeddings
        dtype = self.dtype if cfg.dtype == "auto" else cfg.dtype
        path = str(self.directory)
        return replace(cfg, **self.fields, max_model_len=max_len, dtype=dtype, path=path), notes

    def describe(self, cfg: ModelConfig) -> str:
        weights = self.dtype if cfg.dtype == self.dtype else f"{self.dtype} as {cfg.dtype}"
        return (
            f"model.path={self.directory}: {self.hf_architecture} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
            f"{cfg.num_heads}/{cfg.num_kv_heads} q/kv heads, vocab {cfg.vocab_size}), {weights}, "
            f"max_model_len {cfg.max_model_len}"
        )


def checkpoint_directory(path: str) -> Path:
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ConfigError(
            f"model.path={path}: no such directory; point it at a Hugging Face checkpoint directory "
            "(config.json and *.safetensors)"
        )
    return directory.resolve()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path} cannot be read as JSON: {' '.join(str(error).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_checkpoint_config(path: str) -> CheckpointConfig:
    """Parse and check ``config.json``; a ConfigError names what is missing or unsupported."""
    directory = checkpoint_directory(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ConfigError(
            f"model.path={path} has no config.json; expected a Hugging Face checkpoint directory "
            "with config.json and *.safetensors"
        )
    hf = _read_json(config_file)
    architecture = _architecture(hf, config_file)
    _refuse_unsupported(hf, architecture, config_file)

    def need(key: str) -> int:
        value = hf.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{config_file}: {key} must be a positive integer (got {value!r})")
        return value

    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    rope = _rope_parameters(hf)
    eos = _eos_ids(hf, directory / "generation_config.json")
    max_positions = need("max_position_embeddings")
    if rope.get("rope_type") in ("llama3", "yarn", "dynamic"):
        rope.setdefault("original_max_position_embeddings", max_positions)
        if rope.get("factor") is None and rope["rope_type"] == "yarn":
            rope["factor"] = max_positions / rope["original_max_position_embeddings"]
    def optional(key: str) -> int | None:
        return need(key) if hf.get(key) is not None else None

    def positive(key: str, value: Any) -> float:
        # json reads NaN and Infinity; either would reach the norm or RoPE and make every token 0
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{config_file}: {key} must be a finite number > 0 (got {value!r})")
        return float(value)

    rope_source = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    theta_key = f"{rope_source}.rope_theta" if "rope_theta" in rope else "rope_theta"
    theta = rope.pop("rope_theta", hf.get("rope_theta"))
    arch = registry.hf_architecture([architecture]) or architecture
    fields: dict[str, Any] = {
        "architecture": arch,
        "vocab_size": need("vocab_size"),
        "hidden_size": hidden,
        "num_layers": need("num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": optional("num_key_value_heads") or heads,
        "head_dim": optional("head_dim") or hidden // heads,
        "intermediate_size": need("intermediate_size"),
        "rope_theta": _DEFAULT_ROPE_THETA if theta is None else positive(theta_key, theta),
        "rms_norm_eps": positive("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "attention_bias": arch == "qwen2",
        "qk_norm": arch == "qwen3",
        "eos_token_id": eos[0] if eos else NO_EOS,
        "extra_eos_token_ids": eos[1:],
        "rope_scaling": {} if rope.get("rope_type", "default") == "default" else rope,
        "multimodal": False,
    }
    dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
    if dtype not in DTYPES:
        raise ConfigError(f"{config_file}: torch_dtype={dtype} is not a dtype corelib loads ({', '.join(DTYPES)})")
    return CheckpointConfig(directory, architecture, fields, max_positions, dtype)


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


def _refuse_unsupported(hf: Mapping[str, Any], architecture: str, config_file: Path) -> None:
    """Options of these architectures that this decoder does not compute: refuse rather than mis-compute."""
    problems = []
    quantization = hf.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        problems.append(f"quantization_config (quant_method={method}): quantized checkpoints are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']}: only silu is supported")
    variant = registry.hf_architecture([architecture])
    if variant is not None and not registry.llama_variant(variant).attention_bias and hf.get("attention_bias"):
        problems.append("attention_bias=true: biases on the attention projections are not supported")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias=true: biases on the MLP projections are not supported")
    if hf.get("use_sliding_window"):
        problems.append("use_sliding_window=true: sliding-window attention is not supported")
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        problems.append(f"layer_types={sorted(set(layer_types))}: only full_attention layers are supported")
    if hf.get("partial_rotary_factor") not in (None, 1, 1.0):
        problems.append(f"partial_rotary_factor={hf['partial_rotary_factor']}: only full-width RoPE is supported")
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


def _eos_ids(hf: Mapping[str, Any], generation_file: Path) -> list[int]:
    """config.json's EOS ids, then generation_config.json's (chat models list their end-of-turn there)."""
    ids: list[int] = []
    sources = [hf.get("eos_token_id")]
    if generation_file.is_file():
        sources.append(_read_json(generation_file).get("eos_token_id"))
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and not isinstance(token, bool) and token >= 0 and token not in ids:
                ids.append(token)
    return ids


def resolved_model_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with its checkpoint's values when ``model.path`` is set. Idempotent."""
    if not cfg.path:
        return replace(cfg, dtype="float32") if cfg.dtype == "auto" else cfg
    return read_checkpoint_config(cfg.path).apply(cfg)[0]


def resolve_checkpoint(raw: DictConfig) -> list[str]:
    """The startup hook: write the checkpoint's values into ``raw.model``; returns lines for the user."""
    model = raw.model
    path = model.get("path")
    if not path:
        if model.get("dtype") == "auto":
            model.dtype = "float32"
        return []
    checkpoint = read_checkpoint_config(resolve_model_path(str(path)))  # a hub id becomes its cached snapshot
    current = ModelConfig(name=str(model.name), max_model_len=int(model.max_model_len), dtype=str(model.dtype))
    resolved, notes = checkpoint.apply(current)
    for key in (*checkpoint.fields, "max_model_len", "dtype", "path"):
        model[key] = getattr(resolved, key)
    return [checkpoint.describe(resolved), *notes]
