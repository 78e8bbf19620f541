"""RoPE scaling values the formulas cannot compute with are refused at start, in one line naming the key.

A zero llama3 frequency factor or yarn beta divided by zero (a raw ``ZeroDivisionError``),
a negative beta took a logarithm of a negative number, and a zero or huge yarn attention
factor or mscale ran to the end with every logit infinite: exit 0 and every request failed.
Each value is checked on its own (``model.rope_scaling.KEY`` on the command line, ``config.json:
rope_scaling.KEY`` or ``rope_parameters.KEY`` in a checkpoint), then the table the values make
with the model's RoPE base and head size must be finite, before any weight is built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support import error_lines, every

from corelib.cli.main import main
from corelib.errors import ConfigError
from corelib.models.rope import RopeScaling
from corelib.models.synthetic import tiny_hf_config, write_random_checkpoint

QUICK = ("run", "backend=cpu", "engine.max_num_seqs=2", "workload.num_requests=1", "workload.output_len_min=2",
         "workload.output_len_max=2", "model.max_model_len=64")
LLAMA3 = {"rope_type": "llama3", "factor": 8, "original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 32}

# (the entry, the key and value the line names, and why)
BAD: dict[str, tuple[dict[str, Any], str]] = {
    "llama3-low-zero": ({**LLAMA3, "low_freq_factor": 0}, "low_freq_factor=0: must be > 0"),
    "llama3-high-zero": ({**LLAMA3, "high_freq_factor": 0}, "high_freq_factor=0: must be > 0"),
    "llama3-high-equals-low": ({**LLAMA3, "low_freq_factor": 4, "high_freq_factor": 4},
                               "high_freq_factor=4: must be greater than low_freq_factor=4"),
    "llama3-original-huge": ({**LLAMA3, "original_max_position_embeddings": 10**400},
                             f"original_max_position_embeddings={'1' + '0' * 39}...: must be at most 2147483648"),
    "yarn-beta-fast-zero": ({**YARN, "beta_fast": 0}, "beta_fast=0: must be > 0"),
    "yarn-beta-slow-negative": ({**YARN, "beta_slow": -1}, "beta_slow=-1: must be > 0"),
    "yarn-attention-zero": ({**YARN, "attention_factor": 0}, "attention_factor=0: must be in (0, 10]"),
    "yarn-attention-huge": ({**YARN, "attention_factor": 1e308}, "attention_factor=1e+308: must be in (0, 10]"),
    "yarn-mscale-huge": ({**YARN, "mscale": 1e308, "mscale_all_dim": 1}, "mscale=1e+308: must be in [0, 10]"),
    "yarn-mscale-all-dim-negative": ({**YARN, "mscale": 1, "mscale_all_dim": -100},
                                     "mscale_all_dim=-100: must be in [0, 10]"),
    "yarn-original-zero": ({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 0},
                           "original_max_position_embeddings=0: rope_type=yarn needs a positive integer"),
    "linear-factor-zero": ({"rope_type": "linear", "factor": 0}, "factor=0: rope_type=linear needs a factor in"),
    "yarn-factor-inf": ({**YARN, "factor": float("inf")}, "factor=inf: must be a finite number"),
    "yarn-beta-text": ({**YARN, "beta_fast": "32"}, "beta_fast='32': must be a finite number"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_each_bad_value_is_refused_naming_its_key(name: str) -> None:
    entry, says = BAD[name]
    with pytest.raises(ConfigError) as refused:
        RopeScaling.from_entry(entry)
    assert str(refused.value).startswith(f"model.rope_scaling.{says}"), str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("entry", [
    LLAMA3, YARN, {"rope_type": "linear", "factor": 4.0},
    {**YARN, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},  # DeepSeek-V3's
    {**LLAMA3, "factor": 32, "low_freq_factor": 1, "high_freq_factor": 4},  # Llama 3.2's
    {**YARN, "factor": 32, "truncate": False, "attention_factor": 1.3},
])
def test_the_values_real_checkpoints_use_are_taken(entry: dict[str, Any]) -> None:
    assert RopeScaling.from_entry(entry) is not None


# ----------------------------------------------------------------------------- through corelib run


def run_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
            *args: str) -> tuple[int, list[str]]:
    monkeypatch.chdir(tmp_path)
    code = main([*QUICK, *args])
    return code, error_lines(capsys.readouterr().err)


def assert_one_error(result: tuple[int, list[str]], starts: str) -> None:
    code, lines = result
    assert code == 2, f"exit {code}: {lines}"
    assert len(lines) == 1 and lines[0].startswith(f"corelib: error: {starts}"), lines


def checkpoint_with(tmp_path: Path, **changes: Any) -> Path:
    """A valid checkpoint whose config.json then gets ``changes`` (written valid: its weights follow its shape)."""
    checkpoint = tmp_path / "model"
    write_random_checkpoint(checkpoint, tiny_hf_config())
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, **changes}))
    return checkpoint


def overrides(entry: dict[str, Any]) -> list[str]:
    return [f"+model.rope_scaling.{key}={json.dumps(value) if isinstance(value, str) else value}"
            for key, value in entry.items()]


@pytest.mark.slow
@pytest.mark.parametrize("name", every(4, [n for n in BAD if n not in ("llama3-original-huge", "yarn-beta-text")]))
def test_the_command_line_refuses_each_in_one_line(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    entry, says = BAD[name]
    assert_one_error(run_cli(tmp_path, capsys, monkeypatch, *overrides(entry)), f"model.rope_scaling.{says}")


@pytest.mark.slow
@pytest.mark.parametrize(("extra", "says"), [
    (("model.rope_theta=1",), "model.rope_scaling (rope_type=yarn) with model.rope_theta=1.0 and head_dim="),
    (("+model.rope_scaling.beta_fast=1e-320",), "model.rope_scaling (rope_type=yarn) with model.rope_theta=10000.0"),
])
def test_values_that_are_fine_alone_but_not_with_the_models_base_are_refused(
    extra: tuple[str, ...], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_one_error(run_cli(tmp_path, capsys, monkeypatch, *overrides(YARN), *extra), says)


@pytest.mark.slow
@pytest.mark.parametrize("name", every(4, [name for name in BAD if name not in ("yarn-factor-inf",)]))
def test_a_checkpoint_is_refused_naming_its_config_json_key(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    entry, says = BAD[name]
    checkpoint = checkpoint_with(tmp_path, rope_scaling=entry)
    assert_one_error(run_cli(tmp_path, capsys, monkeypatch, f"model.path={checkpoint}"),
                     f"{checkpoint}/config.json: rope_scaling.{says}")


@pytest.mark.slow
@pytest.mark.parametrize(("entry", "says"), [
    ({"rope_type": "yarn", "original_max_position_embeddings": 0},  # its factor would be derived from it
     "rope_scaling.original_max_position_embeddings=0: rope_type=yarn needs a positive integer"),
    ({"rope_type": "yarn", "original_max_position_embeddings": "4096"},
     "rope_scaling.original_max_position_embeddings='4096': expected an integer"),
])
def test_a_yarn_checkpoint_without_a_factor_is_refused_naming_what_it_would_come_from(
    entry: dict[str, Any], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = checkpoint_with(tmp_path, rope_scaling=entry)
    assert_one_error(run_cli(tmp_path, capsys, monkeypatch, f"model.path={checkpoint}"),
                     f"{checkpoint}/config.json: {says}")


@pytest.mark.slow
def test_transformers_5s_rope_parameters_are_named_as_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = checkpoint_with(tmp_path, rope_parameters={**YARN, "rope_theta": 10000.0, "beta_fast": 0})
    assert_one_error(run_cli(tmp_path, capsys, monkeypatch, f"model.path={checkpoint}"),
                     f"{checkpoint}/config.json: rope_parameters.beta_fast=0: must be > 0")
