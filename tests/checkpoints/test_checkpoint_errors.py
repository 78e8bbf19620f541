"""A checkpoint that does not fit stops `run` with exit code 2 and one line naming what was expected."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from support import error_lines, every

from corelib.cli.main import main
from corelib.engine.api import Engine
from corelib.errors import ConfigError
from corelib.models.synthetic import tiny_hf_config, write_random_checkpoint

pytestmark = pytest.mark.slow


def run_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    """Run `python -m corelib run ...` in-process; returns its one error line (and checks exit code 2)."""
    monkeypatch.chdir(tmp_path)
    code = main(["run", "backend=cpu", "engine.max_num_seqs=2", "workload.num_requests=1", *args])
    assert code == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1, f"expected one error line, got {lines}"
    assert lines[0].startswith("corelib: error: ")
    return lines[0]


def edit_config(directory: Path, **changes: object) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def no_config(d: Path) -> None:
    (d / "config.json").unlink()


def no_weights(d: Path) -> None:
    (d / "model.safetensors").rename(d / "pytorch_model.bin")


def missing_shard(d: Path) -> None:
    index = {"weight_map": {"lm_head.weight": "model-9.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def corrupt(d: Path) -> None:
    (d / "model.safetensors").write_bytes(b"\x00" * 64)


def gemma(d: Path) -> None:
    edit_config(d, architectures=["GemmaForCausalLM"])


def wrong_shape(d: Path) -> None:
    edit_config(d, intermediate_size=96)


def missing_tensor(d: Path) -> None:
    edit_config(d, tie_word_embeddings=False, num_hidden_layers=3)


def yarn_variant(d: Path) -> None:
    edit_config(d, rope_scaling={"rope_type": "longrope", "factor": 2.0})


def sliding_window(d: Path) -> None:
    edit_config(d, use_sliding_window=True, sliding_window=64)


def quantized(d: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), framework="pt") as handle:
        state = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 - not a dict
    state["model.layers.0.mlp.down_proj.weight"] = state["model.layers.0.mlp.down_proj.weight"].to(torch.int8)
    save_file(state, str(d / "model.safetensors"))


CASES: dict[str, tuple[Callable[[Path], None], list[str]]] = {
    "no config.json": (no_config, ["has no config.json", "config.json and *.safetensors"]),
    "no safetensors": (no_weights, ["has no *.safetensors", "pytorch_model.bin", "safe_serialization=True"]),
    "missing shard": (missing_shard, ["names shard model-9.safetensors, which is missing"]),
    "corrupt file": (corrupt, ["model.safetensors is not a readable safetensors file"]),
    "architecture": (gemma, ["GemmaForCausalLM", "is not supported; supported: LlamaForCausalLM, ",
                             "Qwen3ForCausalLM"]),
    "shape": (wrong_shape, ["'model.layers.0.mlp.gate_proj.weight'", "(160, 64)", "(96, 64)"]),
    "missing tensor": (missing_tensor, ["lacks tensor 'lm_head.weight' and 9 more", "tie_word_embeddings=false"]),
    "rope type": (yarn_variant, ["rope_type=longrope", "supported: default, linear, dynamic, llama3, yarn"]),
    "sliding window": (sliding_window, ["use_sliding_window=true", "not supported"]),
    "quantized": (quantized, ["'model.layers.0.mlp.down_proj.weight'", "dtype I8", "quantized"]),
}


@pytest.mark.parametrize("case", every(2, list(CASES)))
def test_a_broken_checkpoint_is_one_line_naming_what_was_expected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    directory = tmp_path / "model"
    write_random_checkpoint(directory, tiny_hf_config(tie_word_embeddings=True))
    damage, expected = CASES[case]
    damage(directory)
    line = run_cli(tmp_path, capsys, monkeypatch, f"model.path={directory}")
    for fragment in expected:
        assert fragment in line, f"{fragment!r} not in {line!r}"


def test_a_missing_directory_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    line = run_cli(tmp_path, capsys, monkeypatch, f"model.path={tmp_path / 'nowhere'}")
    assert f"model.path={tmp_path / 'nowhere'}: no such directory" in line


def test_text_prompts_without_a_tokenizer_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    write_random_checkpoint(tmp_path / "model", tiny_hf_config())
    line = run_cli(tmp_path, capsys, monkeypatch, f"model.path={tmp_path / 'model'}", "workload.prompts=[hello]")
    assert "workload.prompts are text and need a tokenizer" in line and "tokenizer.json" in line
    with Engine.from_overrides(["backend=cpu", "engine.max_num_seqs=2"]) as engine, \
            pytest.raises(ConfigError, match=r"a text prompt needs a tokenizer, but model=tiny is a preset with random "
                                             r"weights and no tokenizer: pass token ids"):
        engine.add_request("hello")
