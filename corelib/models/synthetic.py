"""Write random Hugging Face-format checkpoints (and a toy tokenizer) for tests and benchmarks.

No model hub is needed: the directory looks like one ``save_pretrained`` writes, with
``config.json``, ``model.safetensors`` or shards plus ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from corelib.config.schema import ModelConfig
from corelib.models.checkpoint import INDEX_FILE
from corelib.models.hf_config import read_checkpoint_config
from corelib.models.random_init import random_state_dict
from corelib.models.registry import model_shape
from corelib.support.text import TOKENIZER_FILE


def tiny_hf_config(architecture: str = "LlamaForCausalLM", **overrides: Any) -> dict[str, Any]:
    """A small, valid ``config.json`` of ``architecture``; ``overrides`` replace or add keys."""
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": architecture.removesuffix("ForCausalLM").lower(),
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    if architecture == "Qwen3ForCausalLM":
        config["head_dim"] = 32  # Qwen3 sets head_dim independently of hidden_size / heads
    config.update(overrides)
    return config


def write_random_checkpoint(
    directory: Path,
    hf_config: Mapping[str, Any],
    shards: int = 1,
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Write ``config.json`` and random weights into ``directory``; returns the weights as written."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(dict(hf_config), indent=2) + "\n")
    checkpoint = read_checkpoint_config(str(directory))
    model = checkpoint.apply(ModelConfig(name="synthetic", dtype="auto"))[0]
    shape = model_shape(model)
    target = dtype or shape.dtype
    state = {name: t.to(target).contiguous() for name, t in random_state_dict(shape, seed).items()}
    names = list(state)
    if shards <= 1:
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return state
    per_shard = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    for index in range(shards):
        shard = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: state[name] for name in names[index * per_shard : (index + 1) * per_shard]}
        save_file(part, str(directory / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index_doc, indent=2) + "\n")
    return state


def write_toy_tokenizer(directory: Path, corpus: Sequence[str], vocab_size: int = 300) -> Path:
    """Train a small byte-level BPE tokenizer on ``corpus`` and save it as ``tokenizer.json``.

    Ids 0 and 1 are the special tokens ``<s>`` (BOS, added to every encoding) and ``</s>`` (EOS).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / TOKENIZER_FILE
    tokenizer.save(str(path))
    return path


DEMO_CORPUS = (
    "Hello, my name is Ada. The capital of France is Paris. Three facts about the Moon: it is round, "
    "it is far away, and it turns around the Earth. The quick brown fox jumps over the lazy dog."
)
DEMO_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_text_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3 checkpoint with a toy tokenizer and a chat template: text in, (random) text out.

    What a test or an example uses where a real checkpoint would take minutes to load.
    """
    write_random_checkpoint(directory, tiny_hf_config("Qwen3ForCausalLM"), seed=seed)
    write_toy_tokenizer(directory, [DEMO_CORPUS] * 8)
    (directory / "chat_template.jinja").write_text(DEMO_CHAT_TEMPLATE)
    return directory


def hub_snapshot(cache: Path, repo_id: str, revision: str = "0" * 40) -> Path:
    """The snapshot directory of ``repo_id`` in a Hugging Face cache laid out as the hub client lays it out.

    Write a checkpoint into it, and ``model.path=repo_id`` finds it offline (``HF_HUB_CACHE=cache``).
    """
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot
