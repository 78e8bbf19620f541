"""The KV pool sized from memory, the checkpoint's dtype and context by default, and generation_config's
sampling defaults in LLM and the server."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from corelib.config.schema import CorelibConfig, EngineConfig, ModelConfig
from corelib.errors import ConfigError
from corelib.models.synthetic import tiny_hf_config, write_random_checkpoint, write_toy_tokenizer
from corelib.plugins import PluginRegistry
from corelib.sampling_params import SamplingParams
from corelib.startup.compose import compose_config, prepare_config_store
from corelib.startup.kv_pool import MemoryFigures, block_bytes, size_pool
from corelib.startup.start import Startup, start
from corelib.step.buckets import blocks_for

GIB = 1 << 30
GENERATION = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 5,
              "eos_token_id": 1}


def _config(max_model_len: int = 4096, **engine: object) -> CorelibConfig:
    model = ModelConfig(name="unit", num_layers=2, num_kv_heads=2, hidden_size=128, num_heads=4,
                        max_model_len=max_model_len, dtype="bfloat16")
    return CorelibConfig(engine=EngineConfig(**engine), model=model)  # type: ignore[arg-type]


def _figures(total: int, free: int | None = None, used: int = 0, activations: int = 0, graphs: int = 0,
             where: str = "device memory") -> MemoryFigures:
    return MemoryFigures(total, total if free is None else free, used, activations, graphs, measured=True,
                         where=where)


def test_a_long_context_gets_the_share_of_memory_left_after_weights_activations_and_graphs() -> None:
    config = _config(max_model_len=1 << 16, max_num_seqs=256)
    per_block = block_bytes(config)
    # 2 layers x K,V x 16 tokens x 2 heads x 32 wide x 2 bytes, and an int64 token id per slot
    assert per_block == 2 * 2 * 16 * 2 * 32 * 2 + 16 * 8
    pool = size_pool(config, _figures(10 * GIB, used=3 * GIB, activations=GIB, graphs=GIB // 2), False)
    assert pool.num_blocks == int(0.9 * 10 * GIB - 3 * GIB - GIB - GIB // 2) // per_block
    assert pool.tokens == (pool.num_blocks - 1) * 16
    assert pool.num_blocks < 256 * 4096 + 1, "what 256 requests of 65,536 tokens need is over the share"
    line = pool.lines[0]
    assert line.startswith(f"KV pool: {pool.num_blocks} blocks of 16 tokens ({pool.tokens} tokens")
    assert "engine.gpu_memory_utilization=0.9 of 10.0 GiB device memory after 3.0 GiB in use" in line
    half = size_pool(replace(config, engine=replace(config.engine, gpu_memory_utilization=0.5)),
                     _figures(10 * GIB, used=3 * GIB, activations=GIB, graphs=GIB // 2), False)
    assert half.num_blocks == int(0.5 * 10 * GIB - 4.5 * GIB) // per_block


def test_memory_another_process_holds_is_not_counted_on() -> None:
    config = _config(max_model_len=1 << 16, max_num_seqs=256)
    pool = size_pool(config, _figures(10 * GIB, free=2 * GIB, used=GIB), False)
    assert pool.num_blocks == 2 * GIB // block_bytes(config)
    assert "(only 2.0 GiB free)" in pool.lines[0]


@pytest.mark.parametrize("where", ["device memory", "host memory"])
def test_the_pool_is_at_most_what_the_requests_need_and_less_when_memory_is_short(where: str) -> None:
    # The share is a ceiling: a short context does not take the device for blocks no request would use.
    config = _config(max_model_len=512, max_num_seqs=8)
    plenty = size_pool(config, _figures(64 * GIB, where=where), False)
    assert plenty.num_blocks == 8 * 32 + 1
    assert "what engine.max_num_seqs=8 requests of model.max_model_len=512 need" in plenty.lines[0]
    assert f"of 64.0 GiB {where}" in plenty.lines[0] and "would allow" in plenty.lines[0]
    short = size_pool(config, _figures(100 * block_bytes(config), where=where), False)
    assert short.num_blocks == 90


def test_an_explicit_block_count_and_a_device_that_cannot_say_keep_the_request_sized_pool() -> None:
    assert size_pool(_config(num_kv_blocks=77), _figures(GIB), False).num_blocks == 77
    pool = size_pool(_config(max_model_len=512, max_num_seqs=2), None, False)
    assert pool.num_blocks == 2 * 32 + 1
    assert "does not report its memory" in pool.lines[0]


def test_the_default_context_is_cut_to_what_the_pool_holds_and_an_explicit_one_is_refused() -> None:
    config = _config(max_model_len=32768)
    figures = _figures(0, free=0)
    figures = replace(figures, total=int(11 * block_bytes(config) / 0.9) + 1, free=GIB)
    pool = size_pool(config, figures, default_context=True)
    assert (pool.num_blocks, pool.max_model_len) == (11, 160)
    assert pool.lines[1].startswith("model.max_model_len=160: cut from the model's 32768, as the KV pool holds 160")
    with pytest.raises(ConfigError, match=r"^model\.max_model_len=32768 needs 2048 KV blocks .* raise "
                                          r"engine\.gpu_memory_utilization"):
        size_pool(config, figures, default_context=False)


def test_a_share_that_leaves_no_block_is_one_line_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^engine\.gpu_memory_utilization=0\.9 of 1\.0 GiB device memory after "
                                          r"1\.0 GiB in use .* not two blocks"):
        size_pool(_config(), _figures(GIB, used=GIB), False)


# ---------------------------------------------------------------------------------------------- startup


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("bf16")
    write_random_checkpoint(directory, tiny_hf_config(torch_dtype="bfloat16", max_position_embeddings=320),
                            dtype=torch.bfloat16)
    (directory / "generation_config.json").write_text(json.dumps(GENERATION))
    write_toy_tokenizer(directory, ["the quick brown fox jumps over the lazy dog"] * 8)
    return directory


def _start(*overrides: str) -> Startup:
    registry = PluginRegistry()
    prepare_config_store(registry)
    return start(compose_config(list(overrides)), registry)


@pytest.mark.slow  # starts the config (and an engine) more than once
def test_auto_dtype_is_the_checkpoints_on_an_emulated_accelerator_and_float32_on_the_cpu(bf16_dir: Path) -> None:
    npu = _start("backend=npu", f"model.path={bf16_dir}")
    assert npu.config.model.dtype == "bfloat16"
    assert any(m.startswith("model.dtype=auto: bfloat16, the checkpoint's") for m in npu.messages)
    cpu = _start("backend=cpu", f"model.path={bf16_dir}")
    assert cpu.config.model.dtype == "float32"
    assert any(m.startswith("model.dtype=auto: float32, as the device is the host") for m in cpu.messages)
    assert _start("backend=npu", f"model.path={bf16_dir}", "model.dtype=float16").config.model.dtype == "float16"
    assert _start("backend=npu").config.model.dtype == "float32", "random weights: float32"


@pytest.mark.slow  # starts the config (and an engine) more than once
def test_max_model_len_is_the_checkpoints_unless_set(bf16_dir: Path) -> None:
    started = _start("backend=cpu", f"model.path={bf16_dir}")
    assert started.config.model.max_model_len == 320 and started.default_context
    assert "model.max_model_len=320: the checkpoint's max_position_embeddings=320" in started.messages
    explicit = _start("backend=cpu", f"model.path={bf16_dir}", "model.max_model_len=64")
    assert explicit.config.model.max_model_len == 64 and not explicit.default_context
    assert _start("backend=cpu").config.model.max_model_len == 512, "a preset keeps its own"


@pytest.mark.slow  # starts the config (and an engine) more than once
def test_generation_config_becomes_the_sampling_defaults_unless_set(bf16_dir: Path) -> None:
    started = _start("backend=cpu", f"model.path={bf16_dir}")
    assert started.config.model.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                                      "repetition_penalty": 1.1, "max_tokens": 5}
    assert any(m.startswith("sampling defaults from generation_config.json: temperature=0.6") for m in started.messages)
    assert _start("backend=cpu", f"model.path={bf16_dir}", "model.generation_config=false").config.model \
        .sampling_defaults == {}
    mine = _start("backend=cpu", f"model.path={bf16_dir}", "+model.sampling_defaults.temperature=0.2")
    assert mine.config.model.sampling_defaults["temperature"] == 0.2, "a value set in the config wins"
    assert mine.config.model.sampling_defaults["top_k"] == 20


@pytest.mark.parametrize(("override", "error"), [
    ("+model.sampling_defaults.seed=3", r"^model\.sampling_defaults\.seed: not a sampling default; allowed: "),
    ("+model.sampling_defaults.temperature=-1", r"^model\.sampling_defaults\.temperature: temperature=-1"),
    ("engine.gpu_memory_utilization=0", r"^engine\.gpu_memory_utilization=0\.0: must be in \(0, 1\]"),
])
def test_bad_values_are_one_line_naming_the_key(override: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        _start("backend=cpu", override)


def test_a_bad_generation_config_value_names_the_file_and_key(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, tiny_hf_config())
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ConfigError, match=r"generation_config\.json: temperature must be a number"):
        _start("backend=cpu", f"model.path={tmp_path}")


# ---------------------------------------------------------------------------------------------- LLM and server


@pytest.mark.slow  # builds an engine
def test_llm_takes_gpu_memory_utilization_and_reports_the_pool() -> None:
    from corelib import LLM

    with LLM("tiny", backend="npu", gpu_memory_utilization=0.5, max_num_seqs=2) as llm:
        [line] = [n for n in llm.engine.notices if n.startswith("KV pool:")]
        assert "engine.gpu_memory_utilization=0.5 of" in line
        assert line.startswith(f"KV pool: {llm.engine.layout.num_blocks} blocks of 16 tokens")
        assert llm.engine.layout.num_blocks == 2 * 32 + 1


@pytest.mark.slow  # builds an engine
def test_the_default_context_is_cut_when_the_pool_cannot_hold_it(bf16_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   ) -> None:
    """An engine whose (fake) host memory holds 11 blocks beside its weights and largest step."""
    import corelib.platform.device
    from corelib.engine.api import Engine
    from corelib.startup.kv_pool import estimate_activations, profile_tokens
    from corelib.startup.limits import weight_bytes

    started = _start("backend=npu", f"model.path={bf16_dir}", "engine.max_num_seqs=2")
    config = started.config
    need = weight_bytes(config) + estimate_activations(config, profile_tokens(config, True)) + 11 * block_bytes(config)
    monkeypatch.setattr(corelib.platform.device, "host_memory", lambda: (64 * GIB, int(need / 0.9) + 1))
    engine = Engine(started)
    try:
        assert engine.layout.num_blocks == 11
        assert config.model.max_model_len == 160
        assert "model.max_model_len=160: cut from the model's 320" in " ".join(engine.notices)
        [out] = engine.generate([[5] * 170], SamplingParams(max_tokens=4))
        assert out.finish_reason == "error", "a prompt beyond the cut context is refused as before"
    finally:
        engine.close()


@pytest.mark.slow  # builds an engine
def test_llm_generate_without_params_uses_the_checkpoints_defaults(bf16_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from corelib import LLM

    with LLM(str(bf16_dir), backend="cpu", max_num_seqs=2) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.repetition_penalty,
                defaults.max_tokens) == (0.6, 0.9, 20, 1.1, 5)
        seen: list[Sequence[SamplingParams]] = []
        real = llm.engine.generate

        def spy(prompts: object, sampling: Sequence[SamplingParams], **kwargs: object) -> object:
            seen.append(sampling)
            return real(prompts, sampling, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(llm.engine, "generate", spy)
        [out] = llm.generate([[3, 4, 5]], use_tqdm=False)
        assert len(out.outputs[0].token_ids) <= 5
        assert seen[-1][0] == defaults
        mine = SamplingParams(max_tokens=3)
        llm.generate([[3, 4, 5]], mine, use_tqdm=False)
        assert seen[-1][0] == mine, "params given are used as they are"


@pytest.mark.slow  # builds an engine
def test_llm_without_generation_config_samples_at_vllms_temperature() -> None:
    from corelib import LLM

    with LLM("tiny", backend="cpu", max_num_seqs=2) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=1.0)


def test_the_server_fills_in_what_the_request_leaves_out_from_the_defaults() -> None:
    from corelib.server.events import EngineInfo
    from corelib.server.inputs import RequestLimits, prepare_completion
    from corelib.server.protocol import CompletionRequest, parse_body

    info = EngineInfo(None, 64, 100, 4, "m", None, (), tuple({"temperature": 0.6, "top_k": 20,
                                                               "max_tokens": 5}.items()))
    limits = RequestLimits(max_choices=8, max_prompt_tokens=1000)
    [(_, left_out)] = prepare_completion(CompletionRequest(prompt=[1, 2], max_tokens=None), info, limits).requests
    assert (left_out.temperature, left_out.top_k, left_out.max_tokens) == (0.6, 20, 5)
    request = parse_body(json.dumps({"prompt": [1, 2], "temperature": 0.0, "top_k": 3, "max_tokens": 9}).encode(),
                         CompletionRequest)
    [(_, given)] = prepare_completion(request, info, limits).requests
    assert (given.temperature, given.top_k, given.max_tokens) == (0.0, 3, 9)
    plain = replace(info, sampling_defaults=())
    [(_, openai)] = prepare_completion(CompletionRequest(prompt=[1, 2]), plain, limits).requests
    assert openai.temperature == 1.0, "without defaults, OpenAI's"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_bf16_checkpoint_runs_bf16_on_the_gpu_with_its_pool_sized_from_memory(bf16_dir: Path) -> None:
    from corelib.engine.api import Engine

    started = _start("backend=cuda", f"model.path={bf16_dir}")
    assert started.config.model.dtype == "bfloat16"
    engine = Engine(started)
    try:
        [line] = [n for n in engine.notices if n.startswith("KV pool:")]
        assert "engine.gpu_memory_utilization=0.9 of" in line and "device memory" in line and "profiled" in line
        _, total = engine.local_device.memory_info() or (0, 0)
        assert engine.startup.config.model.max_model_len == 320
        need = started.config.engine.max_num_seqs * blocks_for(320, started.config.engine.block_size) + 1
        assert engine.layout.num_blocks == need < 0.9 * total // block_bytes(started.config), \
            "a short context: what the requests need, under the share"
        [out] = engine.generate([[3, 4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out.output_token_ids) == 4
    finally:
        engine.close()
