"""Random weights drawn on the device (``model.init=device``): deterministic, shardable, and what auto picks."""

from __future__ import annotations

import dataclasses

import pytest
import support
import torch
from omegaconf import OmegaConf
from support import EngineFactory, local_weights

from corelib.config.schema import CorelibConfig, ModelConfig, WeightInit
from corelib.engine import Engine, SamplingParams
from corelib.models.llama import LayerWeights, ModelWeights
from corelib.models.random_init import init_on_device, parameter_count, seeded_tensor, seeded_weights, tensor_seed
from corelib.models.reference import reference_generate
from corelib.models.registry import llama_weights, model_shape
from corelib.models.sharding import TensorShard
from corelib.models.weight_map import Init, Source, Split
from corelib.startup.compose import compose_config

CPU = torch.device("cpu")


def _model(*overrides: str) -> ModelConfig:
    config = OmegaConf.to_object(compose_config(list(overrides)))
    assert isinstance(config, CorelibConfig)
    return config.model


def _tensors(weights: ModelWeights) -> dict[str, torch.Tensor]:
    found = {"embed": weights.embed, "norm": weights.norm, "lm_head": weights.lm_head}
    for i, layer in enumerate(weights.layers):
        for field in dataclasses.fields(LayerWeights):
            value = getattr(layer, field.name)
            if isinstance(value, torch.Tensor):
                found[f"{i}.{field.name}"] = value
    return found


def test_two_builds_with_the_same_seed_are_identical_and_another_seed_differs() -> None:
    shape = model_shape(_model())
    first, second = _tensors(seeded_weights(shape, 7, CPU)), _tensors(seeded_weights(shape, 7, CPU))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    other = _tensors(seeded_weights(shape, 8, CPU))
    assert not any(torch.equal(first[name], other[name]) for name in first)


def test_a_tensor_depends_on_its_name_not_on_what_was_drawn_before() -> None:
    one, zero = (Source(f"model.layers.{i}.mlp.down_proj.weight", (64, 32), Split.row) for i in (1, 0))
    alone = seeded_tensor(one, 0, CPU, torch.float32)
    seeded_tensor(zero, 0, CPU, torch.float32)
    again = seeded_tensor(one, 0, CPU, torch.float32)
    neighbour = seeded_tensor(zero, 0, CPU, torch.float32)
    assert torch.equal(alone, again)
    assert not torch.equal(alone, neighbour)


def test_the_seed_of_a_tensor_is_the_same_in_every_process() -> None:
    # Python's hash() of a str changes per process; ranks would then draw different weights.
    assert tensor_seed(0, "model.embed_tokens.weight") == 2474826750011401591
    assert tensor_seed(1, "model.embed_tokens.weight") != tensor_seed(0, "model.embed_tokens.weight")


def test_the_scales_follow_the_cpu_path() -> None:
    norm = seeded_tensor(Source("model.norm.weight", (4096,), init=Init.norm), 0, CPU, torch.float32)
    matrix = seeded_tensor(Source("model.layers.0.self_attn.o_proj.weight", (256, 1024)), 0, CPU, torch.float32)
    assert abs(float(norm.mean()) - 1.0) < 0.01 and abs(float(norm.std()) - 0.1) < 0.01
    assert abs(float(matrix.std()) - 1024**-0.5) < 0.002
    small = Source("model.norm.weight", (8,), init=Init.norm)
    assert seeded_tensor(small, 0, CPU, torch.bfloat16).dtype is torch.bfloat16


def test_shards_put_together_equal_the_full_tensors() -> None:
    shape = model_shape(_model())
    full = seeded_weights(shape, 0, CPU)
    ranks = [seeded_weights(shape, 0, CPU, TensorShard(rank, 2)) for rank in range(2)]
    assert all(torch.equal(r.embed, full.embed) and torch.equal(r.lm_head, full.lm_head) for r in ranks)
    h, hd, inter = shape.hidden_size, shape.head_dim, shape.intermediate_size
    nq, nkv = shape.num_heads * hd, shape.num_kv_heads * hd
    for i, layer in enumerate(full.layers):
        parts = [r.layers[i] for r in ranks]
        assert torch.equal(torch.cat([p.o for p in parts], dim=1), layer.o)  # row-parallel: input columns
        assert torch.equal(torch.cat([p.down for p in parts], dim=1), layer.down)
        q, k, v = torch.split(layer.qkv, [nq, nkv, nkv])  # column-parallel: heads, fused per rank as q|k|v
        local = [torch.split(p.qkv, [nq // 2, nkv // 2, nkv // 2]) for p in parts]
        for whole, index in ((q, 0), (k, 1), (v, 2)):
            assert torch.equal(torch.cat([piece[index] for piece in local]), whole)
        gate, up = torch.split(layer.gate_up, [inter, inter])
        halves = [torch.split(p.gate_up, [inter // 2, inter // 2]) for p in parts]
        assert torch.equal(torch.cat([x[0] for x in halves]), gate)
        assert torch.equal(torch.cat([x[1] for x in halves]), up)
        assert all(torch.equal(p.input_norm, layer.input_norm) for p in parts)
        assert tuple(layer.o.shape) == (h, nq)


@pytest.mark.slow
def test_auto_draws_models_above_a_billion_parameters_on_the_device() -> None:
    for preset, on_device in (("tiny", False), ("small-0.6b", False), ("llama-1b", True), ("llama-8b", True)):
        cfg = _model(f"model={preset}")
        assert init_on_device(cfg, model_shape(cfg)) is on_device, preset
    tiny = _model("model.init=device")
    assert init_on_device(tiny, model_shape(tiny))
    big = _model("model=llama-8b", "model.init=cpu")
    assert not init_on_device(big, model_shape(big))


def test_the_llama_8b_preset_has_the_llama_3_1_8b_shape() -> None:
    cfg = _model("model=llama-8b")
    shape = model_shape(cfg)
    assert (shape.vocab_size, shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_kv_heads,
            shape.head_dim, shape.intermediate_size) == (128256, 4096, 32, 32, 8, 128, 14336)
    assert shape.dtype is torch.bfloat16 and shape.rope_theta == 500000.0 and not shape.tie_word_embeddings
    assert shape.rope_scaling is not None and shape.rope_scaling.rope_type == "llama3"
    assert (cfg.eos_token_id, cfg.extra_eos_token_ids) == (128001, [128009])
    assert parameter_count(shape) == 8_030_261_248  # Llama-3.1-8B's count


def test_the_llama_1b_preset_has_the_llama_3_2_1b_shape() -> None:
    cfg = _model("model=llama-1b")
    shape = model_shape(cfg)
    assert (shape.vocab_size, shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_kv_heads,
            shape.head_dim, shape.intermediate_size) == (128256, 2048, 16, 32, 8, 64, 8192)
    assert shape.dtype is torch.bfloat16 and shape.rope_theta == 500000.0 and shape.tie_word_embeddings
    scaling = shape.rope_scaling
    assert scaling is not None and scaling.rope_type == "llama3" and scaling.factor == 32.0
    assert parameter_count(shape) == 1_235_814_400  # Llama-3.2-1B's count (the LM head is the embedding)


def test_model_init_chooses_the_weights_the_engine_builds() -> None:
    cpu_path = llama_weights(_model("model.init=cpu"), CPU)
    device_path = llama_weights(_model("model.init=device"), CPU)
    assert not torch.equal(cpu_path.embed, device_path.embed)
    assert torch.equal(device_path.embed, seeded_weights(model_shape(_model()), 0, CPU).embed)
    assert WeightInit(_model().init) is WeightInit.auto


def test_an_engine_on_device_drawn_weights_matches_the_reference(make_engine: EngineFactory) -> None:
    overrides = ["backend=cpu", "model.init=device"]
    engine = make_engine(overrides)
    reference = support.seeded_weights(overrides)  # from the config alone, as the reference tests build it
    assert torch.equal(reference.embed, local_weights(engine).embed)
    prompts = [[5, 6, 7], list(range(10, 30))]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.output_token_ids == reference_generate(reference, prompt, 8)


@pytest.mark.slow
@pytest.mark.long  # two ranks, each a process importing torch
def test_tp2_on_device_drawn_weights_gives_the_tokens_of_tp1() -> None:
    prompts = [[5, 6, 7], list(range(10, 40)), [3, 4]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def tokens(*overrides: str) -> list[list[int]]:
        with Engine.from_overrides(["backend=cpu", "model.init=device", *overrides]) as engine:
            return [o.output_token_ids for o in engine.generate(prompts, params)]

    assert tokens("engine.transport=shm", "engine.tp=2") == tokens()
