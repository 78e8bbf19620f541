"""``model.path=org/name``: a checkpoint from the Hugging Face cache, laid out as the hub client lays it out."""

from __future__ import annotations

from pathlib import Path

import pytest

from corelib.engine.api import Engine
from corelib.engine.sequence import SamplingParams
from corelib.errors import ConfigError
from corelib.models.synthetic import tiny_hf_config, write_random_checkpoint
from corelib.trust.hub import is_hub_id, resolve_model_path

REVISION = "0123456789abcdef0123456789abcdef01234567"


def cache_with(cache: Path, repo_id: str) -> Path:
    """``cache/models--org--name/{refs/main, snapshots/<rev>/...}`` with a tiny random checkpoint; the snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    write_random_checkpoint(snapshot, tiny_hf_config("Qwen3ForCausalLM"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never the network, whatever the machine has
    return cache


def greedy(path: str) -> list[list[int]]:
    with Engine.from_overrides(["backend=cpu", "engine.max_num_seqs=2", f"model.path={path}"]) as engine:
        outputs = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=6, ignore_eos=True))
        assert engine.startup.config.model.architecture == "qwen3"
        return [o.output_token_ids for o in outputs]


@pytest.mark.slow
def test_a_hub_id_runs_the_cached_checkpoint(offline_cache: Path) -> None:
    snapshot = cache_with(offline_cache, "tiny-org/tiny-qwen3")
    assert resolve_model_path("tiny-org/tiny-qwen3") == str(snapshot)
    assert greedy("tiny-org/tiny-qwen3") == greedy(str(snapshot))


def test_a_hub_id_neither_on_disk_nor_cached_is_one_line(offline_cache: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        Engine.from_overrides(["backend=cpu", "model.path=tiny-org/not-downloaded"])
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("model.path=tiny-org/not-downloaded is neither a directory nor in the Hugging Face "
                              f"cache {offline_cache}")
    assert "hf download tiny-org/not-downloaded" in message


def test_a_directory_wins_over_a_hub_id(offline_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache_with(offline_cache, "models/tiny")
    monkeypatch.chdir(tmp_path)
    write_random_checkpoint(tmp_path / "models" / "tiny", tiny_hf_config())  # ./models/tiny, relative
    assert resolve_model_path("models/tiny") == "models/tiny"


@pytest.mark.parametrize(("value", "is_id"), [
    ("Qwen/Qwen3-0.6B", True), ("meta-llama/Llama-3.2-1B", True), ("/models/qwen", False),
    ("~/models/qwen", False), ("./qwen", False), ("qwen", False), ("a/b/c", False), ("../x", False),
])
def test_what_reads_as_a_hub_id(value: str, is_id: bool) -> None:
    assert is_hub_id(value) is is_id
