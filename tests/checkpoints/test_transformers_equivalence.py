"""corelib and transformers agree on checkpoints transformers wrote (skipped without transformers).

Every registered Llama-family variant is a case (a new registry line is covered without editing
this file), with the config its transformers class defaults to; a few more cases add what a
checkpoint's config.json may change (tied embeddings, RoPE scaling, a window, wider heads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from corelib.engine.api import Engine
from corelib.engine.sequence import SamplingParams
from corelib.models.hf_config import read_checkpoint_config
from corelib.models.registry import LlamaVariant, llama_variant, llama_variants
from corelib.models.rope import RopeScaling, inv_freq

transformers = pytest.importorskip("transformers")

PROMPTS = [[3, 141, 59, 26, 53, 58, 97], [9, 32, 38, 46], [264, 33, 8, 32, 79, 50, 28, 84, 19, 71, 69]]
NEW_TOKENS = 24
SMALL = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "eos_token_id": 2,
    "pad_token_id": 0,  # within the small vocabulary (Phi-3's default is not)
}


def save_random_model(directory: Path, architecture: str, seed: int = 0, **config: Any) -> Any:
    """A random transformers model, saved with save_pretrained; weights scaled so greedy picks are clear-cut."""
    model_class = getattr(transformers, architecture)
    model = model_class(model_class.config_class(**{**SMALL, **config}))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.5 * noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)
    model.eval()
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="100KB")
    return model


def hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return [int(t) for t in out[0, len(prompt) :]]


def corelib_greedy(directory: Path) -> list[list[int]]:
    overrides = ["backend=cpu", f"model.path={directory}", "model.dtype=float32", "engine.max_num_seqs=4"]
    with Engine.from_overrides(overrides) as engine:
        outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS))
    return [o.output_token_ids for o in outputs]


def transformers_class(variant: LlamaVariant) -> str:
    """The transformers model class the variant loads checkpoints of; skips the case when there is none."""
    if not variant.hf_architectures:
        pytest.skip(f"Llama-family variant {variant.name!r} loads no Hugging Face architecture, so transformers has "
                    "no model class to compare it with (tests/engine/test_engine_reference.py checks it against "
                    "corelib.models.reference)")
    name = variant.hf_architectures[0]
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name} class for Llama-family variant "
                    f"{variant.name!r}")
    return name


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
# Beyond each variant with its class's defaults: variant name and the config.json values added.
MORE_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tied-llama3-rope": ("llama", {"tie_word_embeddings": True, "rope_scaling": LLAMA3_ROPE}),
    "qwen3-wide-heads-tied-yarn-rope": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True,
                                                   "rope_scaling": YARN_ROPE}),
    "mistral-window-at-the-positions": ("mistral", {"sliding_window": SMALL["max_position_embeddings"]}),
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    **{variant.name: (variant.name, {}) for variant in llama_variants()},
    **MORE_CASES,
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_greedy_tokens_equal_transformers_generate(tmp_path: Path, case: str) -> None:
    variant_name, config = CASES[case]
    variant = llama_variant(variant_name)
    architecture = transformers_class(variant)
    model = save_random_model(tmp_path, architecture, **config)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1, "transformers should have written safetensors shards"
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert read_checkpoint_config(str(tmp_path)).fields["architecture"] == variant.name, \
        f"{architecture} checkpoints load as another variant"
    expected = [hf_greedy(model, prompt) for prompt in PROMPTS]
    assert corelib_greedy(tmp_path) == expected


ROPE_CASES: list[dict[str, Any]] = [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0,
     "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False},
]


@pytest.mark.parametrize("entry", ROPE_CASES, ids=lambda e: f"{e['rope_type']}-{len(e)}")
def test_rope_frequencies_equal_transformers(entry: dict[str, Any]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, theta, max_positions = 64, 500000.0, 256
    config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=max_positions,
                                      rope_scaling={**entry, "rope_theta": theta})
    expected, expected_scale = ROPE_INIT_FUNCTIONS[entry["rope_type"]](config, "cpu")
    ours = {"original_max_position_embeddings": max_positions, **entry}
    actual, scale = inv_freq(head_dim, theta, RopeScaling.parse(ours, max_positions))
    torch.testing.assert_close(actual.float(), expected.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(expected_scale)
