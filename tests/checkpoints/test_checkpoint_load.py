"""Loading Hugging Face-format checkpoints written here with safetensors: single file and sharded."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from support import local_weights

from corelib.config.schema import ModelConfig
from corelib.engine.api import Engine
from corelib.engine.sequence import SamplingParams
from corelib.models.hf_config import resolved_model_config
from corelib.models.llama import build_weights
from corelib.models.reference import reference_generate, reference_logits
from corelib.models.registry import llama_weights, model_shape
from corelib.models.synthetic import tiny_hf_config, write_random_checkpoint
from corelib.plugins import PluginRegistry
from corelib.startup.compose import compose_config, prepare_config_store
from corelib.startup.start import start

PROMPT = [5, 17, 42, 7, 99, 3, 250, 64, 11]
ARCHITECTURES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


def naive_logits(state: dict[str, torch.Tensor], hf: dict[str, Any], ids: list[int]) -> torch.Tensor:
    """Next-token logits straight from the Hugging Face tensors, in float64, head by head.

    Written from the model definitions, sharing no code with corelib.models: RoPE as a complex
    rotation of (x[i], x[i + hd/2]) pairs, attention as an explicit masked softmax per head.
    """
    w = {k: v.double() for k, v in state.items()}
    arch = hf["architectures"][0]
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv_heads = hf["num_key_value_heads"]
    hd = hf.get("head_dim") or hidden // heads
    eps, theta = hf["rms_norm_eps"], hf["rope_theta"]
    steps = len(ids)

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    freqs = torch.tensor([theta ** (-2 * i / hd) for i in range(hd // 2)], dtype=torch.float64)
    angles = torch.outer(torch.arange(steps, dtype=torch.float64), freqs)
    rotation = torch.polar(torch.ones_like(angles), angles)

    def rope(x: torch.Tensor) -> torch.Tensor:  # [T, hd]
        z = torch.complex(x[:, : hd // 2], x[:, hd // 2 :]) * rotation
        return torch.cat([z.real, z.imag], dim=-1)

    x = w["model.embed_tokens.weight"][ids]
    for layer in range(hf["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = norm(x, w[p + "input_layernorm.weight"])
        proj = {}
        for name in "qkv":
            out = h @ w[p + f"self_attn.{name}_proj.weight"].T
            if arch == "Qwen2ForCausalLM":
                out = out + w[p + f"self_attn.{name}_proj.bias"]
            proj[name] = out
        heads_out = []
        for head in range(heads):
            kv = head // (heads // kv_heads)
            q = proj["q"][:, head * hd : (head + 1) * hd]
            k = proj["k"][:, kv * hd : (kv + 1) * hd]
            v = proj["v"][:, kv * hd : (kv + 1) * hd]
            if arch == "Qwen3ForCausalLM":
                q, k = norm(q, w[p + "self_attn.q_norm.weight"]), norm(k, w[p + "self_attn.k_norm.weight"])
            scores = rope(q) @ rope(k).T / math.sqrt(hd)
            scores = scores.masked_fill(torch.ones(steps, steps).triu(1).bool(), float("-inf"))
            heads_out.append(torch.softmax(scores, dim=-1) @ v)
        x = x + torch.cat(heads_out, dim=-1) @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    lm_head = w["model.embed_tokens.weight"] if hf["tie_word_embeddings"] else w["lm_head.weight"]
    return norm(x[-1], w["model.norm.weight"]) @ lm_head.T


def model_config(directory: Path, **changes: Any) -> ModelConfig:
    return resolved_model_config(ModelConfig(name="test", path=str(directory), **changes))


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_loaded_logits_match_reference_and_raw_tensors(tmp_path: Path, architecture: str, shards: int) -> None:
    hf = tiny_hf_config(architecture, tie_word_embeddings=architecture == "Qwen3ForCausalLM")
    state = write_random_checkpoint(tmp_path, hf, shards=shards)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shards > 1)
    cfg = model_config(tmp_path)
    weights = llama_weights(cfg, torch.device("cpu"))
    with torch.inference_mode():
        loaded = reference_logits(weights, PROMPT)
        from_state = reference_logits(build_weights(model_shape(cfg), state, torch.device("cpu")), PROMPT)
        raw = naive_logits(state, hf, PROMPT)
    assert torch.equal(loaded, from_state)
    torch.testing.assert_close(loaded.double(), raw, rtol=1e-4, atol=1e-4)
    if hf["tie_word_embeddings"]:
        assert weights.lm_head is weights.embed, "tied embeddings should share one tensor"


def test_bf16_checkpoint_loads_in_the_selected_dtype(tmp_path: Path) -> None:
    state = write_random_checkpoint(tmp_path, tiny_hf_config(torch_dtype="bfloat16"), dtype=torch.bfloat16)
    as_auto = llama_weights(model_config(tmp_path, dtype="auto"), torch.device("cpu"))
    as_f32 = llama_weights(model_config(tmp_path, dtype="float32"), torch.device("cpu"))
    assert as_auto.embed.dtype == torch.bfloat16
    assert as_f32.embed.dtype == torch.float32
    assert torch.equal(as_f32.embed, state["model.embed_tokens.weight"].float())


def engine_for(directory: Path, *overrides: str) -> Engine:
    return Engine.from_overrides(["backend=cpu", f"model.path={directory}", "engine.max_num_seqs=4", *overrides])


def test_engine_uses_the_checkpoint_shape_everywhere(tmp_path: Path) -> None:
    hf = tiny_hf_config("Qwen3ForCausalLM", vocab_size=300, max_position_embeddings=128)
    write_random_checkpoint(tmp_path, hf, shards=2)
    registry = PluginRegistry()
    prepare_config_store(registry)
    startup = start(compose_config(["backend=cpu", f"model.path={tmp_path}"]), registry)
    model = startup.config.model
    assert (model.architecture, model.vocab_size, model.head_dim, model.max_model_len) == ("qwen3", 300, 32, 128)
    assert startup.raw.model.vocab_size == 300, "config.yaml and the feature gates read the raw config"
    assert any("max_position_embeddings=128" in line for line in startup.messages)
    with engine_for(tmp_path) as engine:
        [bad, good] = engine.generate([[299, 300], PROMPT], SamplingParams(max_tokens=6))
        expected = reference_generate(local_weights(engine), PROMPT, 6, eos_token_id=1)
    assert bad.finish_reason == "error" and "outside the vocabulary [0, 300)" in (bad.error or "")
    assert good.output_token_ids == expected


def test_every_eos_id_of_the_checkpoint_stops_a_request(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, tiny_hf_config(eos_token_id=None))
    with engine_for(tmp_path) as engine:
        [free] = engine.generate([PROMPT], SamplingParams(max_tokens=8))
    assert free.finish_reason == "length"
    stop_at = free.output_token_ids[3]
    first = free.output_token_ids.index(stop_at)
    config = json.loads((tmp_path / "config.json").read_text())
    config["eos_token_id"] = [318, stop_at]  # the second id of a list, as chat models write it
    (tmp_path / "config.json").write_text(json.dumps(config))
    with engine_for(tmp_path) as engine:
        [stopped] = engine.generate([PROMPT], SamplingParams(max_tokens=8))
        [ignored] = engine.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))
    assert stopped.finish_reason == "stop"
    assert stopped.output_token_ids == free.output_token_ids[: first + 1]
    assert ignored.output_token_ids == free.output_token_ids


def test_rope_scaling_from_config_changes_long_range_logits(tmp_path: Path) -> None:
    plain_dir, scaled_dir = tmp_path / "plain", tmp_path / "scaled"
    write_random_checkpoint(plain_dir, tiny_hf_config())
    scaling = {"rope_type": "linear", "factor": 4.0}
    write_random_checkpoint(scaled_dir, tiny_hf_config(rope_scaling=scaling))
    plain = llama_weights(model_config(plain_dir), torch.device("cpu"))
    scaled = llama_weights(model_config(scaled_dir), torch.device("cpu"))
    # Linear scaling by 4 visits position 4p where plain RoPE visits p.
    torch.testing.assert_close(scaled.cos_sin[8], plain.cos_sin[2])
    assert not torch.equal(reference_logits(plain, PROMPT), reference_logits(scaled, PROMPT))
