"""A config.json asking for attention this decoder does not compute is refused in one line, not run wrong."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any

import pytest

from corelib.config.schema import ModelConfig
from corelib.engine.api import Engine
from corelib.errors import ConfigError
from corelib.models import registry
from corelib.models.hf_config import CheckpointConfig, read_checkpoint_config
from corelib.models.registry import DECODER, Activation, Attention, LlamaVariant, Norm, Rope
from corelib.models.synthetic import tiny_hf_config, write_random_checkpoint


def checkpoint_config(directory: Path, **changes: Any) -> CheckpointConfig:
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(tiny_hf_config(**changes)))
    return read_checkpoint_config(str(directory))


def resolved(directory: Path, max_model_len: int, **changes: Any) -> ModelConfig:
    checkpoint = checkpoint_config(directory, **changes)
    return checkpoint.apply(ModelConfig(name="t", max_model_len=max_model_len))[0]


def test_a_window_without_the_qwen2_flag_applies_and_is_refused_past_it(tmp_path: Path) -> None:
    # Mistral-7B-v0.1 writes sliding_window=4096 and no use_sliding_window: the window is on.
    with pytest.raises(ConfigError) as refused:
        resolved(tmp_path, 200, architectures=["MistralForCausalLM"], sliding_window=64)
    line = str(refused.value)
    assert "\n" not in line
    assert "sliding_window=64: sliding-window attention is not supported" in line
    assert "model.max_model_len=200" in line and "model.max_model_len<=64" in line


def test_within_the_window_attention_is_full_and_the_checkpoint_runs(tmp_path: Path) -> None:
    assert resolved(tmp_path, 64, sliding_window=64).max_model_len == 64


def test_the_qwen2_flag_turns_the_window_off_and_on(tmp_path: Path) -> None:
    assert resolved(tmp_path, 200, use_sliding_window=False, sliding_window=32).max_model_len == 200
    with pytest.raises(ConfigError, match=r"sliding_window=32 with use_sliding_window=true: sliding-window"):
        resolved(tmp_path, 200, use_sliding_window=True, sliding_window=32)


def test_sliding_layers_in_layer_types_apply_the_window(tmp_path: Path) -> None:
    layers = ["sliding_attention", "full_attention"]  # alternating local and global layers
    with pytest.raises(ConfigError, match=r"sliding_window=16 \(layer_types: sliding_attention\)"):
        resolved(tmp_path, 200, use_sliding_window=False, sliding_window=16, layer_types=layers)


@pytest.mark.parametrize(("key", "value", "what"), [
    ("attn_logit_softcapping", 50.0, "attention logit soft-capping"),
    ("final_logit_softcapping", 30.0, "final logit soft-capping"),
    ("query_pre_attn_scalar", 256, "an attention scale other than 1/sqrt(head_dim)"),
    ("attention_multiplier", 0.015625, "an attention scale other than 1/sqrt(head_dim)"),
    ("attention_multiplier", 1.0, "an attention scale other than 1/sqrt(head_dim)"),  # Granite's scale itself
    ("sliding_window_pattern", 6, "alternating local and global attention layers"),
    ("attention_chunk_size", 8192, "chunked local attention"),
    ("no_rope_layers", [1, 0], "layers without RoPE"),
    ("partial_rotary_factor", 0.5, "RoPE on part of each head"),
    ("num_local_experts", 8, "mixture-of-experts layers"),
    ("hidden_act", "gelu", "an activation other than silu"),
    ("rope_interleave", True, "interleaved RoPE"),
    ("use_bidirectional_attention", True, "bidirectional attention"),
    ("qk_layernorm", True, "a q/k LayerNorm"),
    ("use_bias", True, "biases on every projection"),
])
def test_attention_variants_are_refused_naming_the_key(tmp_path: Path, key: str, value: object, what: str) -> None:
    with pytest.raises(ConfigError) as refused:
        checkpoint_config(tmp_path, **{key: value})
    line = str(refused.value)
    assert "\n" not in line and f"{key}={json.dumps(value)}" in line and what in line


def test_a_layer_type_other_than_full_or_sliding_attention_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"layer_types has chunked_attention: only full_attention layers"):
        checkpoint_config(tmp_path, layer_types=["full_attention", "chunked_attention"])


@pytest.mark.parametrize(("key", "value"), [
    ("no_rope_layers", [1, 1]), ("partial_rotary_factor", 1.0), ("hidden_act", "silu"),
    ("attn_logit_softcapping", None), ("layer_types", ["full_attention", "full_attention"]),
    ("rope_interleave", False), ("use_bidirectional_attention", False),
])
def test_the_neutral_values_of_those_keys_are_accepted(tmp_path: Path, key: str, value: object) -> None:
    checkpoint_config(tmp_path, **{key: value})


def test_every_problem_is_named_on_the_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        checkpoint_config(tmp_path, attn_logit_softcapping=50.0, mlp_bias=True)
    assert "attn_logit_softcapping=50.0" in str(refused.value) and "mlp_bias=true" in str(refused.value)


INTERLEAVED_REFUSAL = ("Llama-family variant 'llama-meta' declares interleaved RoPE; the decoder computes "
                       "rotate-half RoPE only")


def test_every_registered_llama_variant_declares_only_what_the_decoder_computes() -> None:
    for variant in registry.llama_variants():
        assert variant.refusal() is None, variant.refusal()


def test_a_variant_line_with_interleaved_rope_is_refused_in_one_line_before_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One registry line, as it would be added for Meta-format Llama checkpoints, cannot run rotate-half RoPE."""
    directory = tmp_path / "model"
    write_random_checkpoint(directory, tiny_hf_config())
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaMetaForCausalLM"]}))
    line = LlamaVariant("llama-meta", ("LlamaMetaForCausalLM",), rope=Rope.INTERLEAVED)
    monkeypatch.setitem(registry._REGISTERED, line.name, line)  # as a BUILTIN line registers it
    with pytest.raises(ConfigError) as refused, \
            Engine.from_overrides(["backend=cpu", f"model.path={directory}", "engine.max_num_seqs=2"]):
        pass
    assert str(refused.value) == INTERLEAVED_REFUSAL
    for use in (line.shape, line.facts):  # whatever asks for the variant first
        with pytest.raises(ConfigError, match=INTERLEAVED_REFUSAL):
            use(ModelConfig(name="t", architecture=line.name))


def test_registering_a_variant_with_interleaved_rope_is_refused() -> None:
    line = LlamaVariant("llama-meta", ("LlamaMetaForCausalLM",), rope=Rope.INTERLEAVED)
    with pytest.raises(ConfigError) as refused:
        registry.register(line, "plugin 'meta'")
    assert str(refused.value) == f"plugin 'meta': {INTERLEAVED_REFUSAL}"
    assert "llama-meta" not in registry.names()


DECLARATIONS: list[tuple[str, object, str]] = [
    *[("rope", style, "interleaved RoPE") for style in Rope if style is not DECODER.rope],
    *[("norm", norm, "LayerNorm") for norm in Norm if norm is not DECODER.norm],
    *[("attention", kind, kind.value) for kind in Attention if kind is not DECODER.attention],
    *[("activation", act, act.value) for act in Activation if act is not DECODER.activation],
    ("o_bias", True, "a bias on o_proj; the decoder computes o_proj without a bias only"),
    ("mlp_bias", True, "biases on the MLP projections; the decoder computes the MLP without biases only"),
]


@pytest.mark.parametrize(("field", "value", "said"), DECLARATIONS,
                         ids=[f"{f}-{v.name if isinstance(v, Enum) else v}" for f, v, _ in DECLARATIONS])
def test_each_declaration_the_decoder_does_not_compute_is_refused_by_name(field: str, value: object, said: str) -> None:
    declared: dict[str, Any] = {field: value}
    refusal = LlamaVariant("x", **declared).refusal()
    assert refusal is not None and "\n" not in refusal
    assert refusal.startswith("Llama-family variant 'x' declares ") and said in refusal


def test_several_declarations_are_named_on_the_one_line() -> None:
    refusal = LlamaVariant("x", rope=Rope.INTERLEAVED, norm=Norm.LAYER_NORM).refusal()
    assert refusal == ("Llama-family variant 'x' declares interleaved RoPE and LayerNorm; the decoder computes "
                       "rotate-half RoPE and RMSNorm only")
