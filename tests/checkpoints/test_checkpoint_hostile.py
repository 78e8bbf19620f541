"""Checkpoint directories built to hang corelib, read files outside them, or make it compute garbage.

Each is refused at start with exit 2 and one line naming the file (and the tensor or key):
a FIFO or other non-regular file where weights, a JSON file or the tokenizer should be, index
entries that leave the directory or name a tensor their shard lacks, a file corelib may not
read, NaN or infinite weights, a ``config.json`` whose norm epsilon or RoPE base is not a finite
positive number, whose booleans are strings, whose RoPE scaling is beyond any use or which is
nested beyond what Python parses, and end-of-sequence lists that are not token ids or are long
enough to make start-up quadratic. A Hugging Face cache snapshot, whose files are symlinks
into ``../../blobs``, still loads.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from support import error_lines, every, run_python

from corelib.cli.main import main
from corelib.models import hf_config
from corelib.models.synthetic import tiny_hf_config, write_random_checkpoint

pytestmark = pytest.mark.slow

TENSOR = "model.layers.0.mlp.up_proj.weight"
QUICK = ("run", "backend=cpu", "engine.max_num_seqs=2", "workload.num_requests=1", "workload.output_len_min=2",
         "workload.output_len_max=2", "model.max_model_len=64")


def run_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
            *args: str) -> tuple[int, list[str]]:
    """``python -m corelib run ...`` in-process; the exit code and the lines on stderr."""
    monkeypatch.chdir(tmp_path)
    code = main([*QUICK, *args])
    return code, error_lines(capsys.readouterr().err)


def one_error(result: tuple[int, list[str]], *fragments: str) -> None:
    code, lines = result
    assert code == 2, f"exit {code}: {lines}"
    assert len(lines) == 1 and lines[0].startswith("corelib: error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    write_random_checkpoint(directory, tiny_hf_config())
    return directory


def edit_tensor(directory: Path, change: Callable[[dict[str, torch.Tensor]], None],
                name: str = "model.safetensors") -> None:
    with safe_open(str(directory / name), framework="pt") as handle:
        state = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 - not a dict
    change(state)
    save_file(state, str(directory / name), metadata={"format": "pt"})


def move_outside(directory: Path, target: str) -> None:
    """Move the weights out of the directory and point an index at them with ``target``."""
    outside = directory.parent / "outside.safetensors"
    (directory / "model.safetensors").rename(outside)
    with safe_open(str(outside), framework="pt") as handle:
        names = list(handle.keys())
    index = {"weight_map": dict.fromkeys(names, target.format(outside=outside))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def test_a_fifo_named_model_safetensors_is_refused_not_waited_on(checkpoint: Path, tmp_path: Path) -> None:
    (checkpoint / "model.safetensors").unlink()
    os.mkfifo(checkpoint / "model.safetensors")
    # In a child process: before this was refused, safetensors waited on the FIFO forever, deaf to signals.
    result = run_python(["-m", "corelib", *QUICK, f"model.path={checkpoint}"], cwd=tmp_path, timeout=90)
    assert result.returncode == 2, result.stderr
    assert f"{checkpoint}/model.safetensors is a FIFO, not a regular file" in result.stderr


@pytest.mark.parametrize(("target", "says"), [("../outside.safetensors", "'../outside.safetensors'"),
                                               ("{outside}", "outside.safetensors'; a shard must be a file name")])
def test_index_entries_that_leave_the_directory_are_refused(
    target: str, says: str, checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    move_outside(checkpoint, target)
    one_error(run_cli(tmp_path, capsys, monkeypatch, f"model.path={checkpoint}"), "model.safetensors.index.json",
              says, "(no absolute path, no '..')")


def test_a_hugging_face_cache_snapshot_of_symlinks_still_loads(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (checkpoint / "model.safetensors").rename(blobs / "1f2e3d")
    (checkpoint / "model.safetensors").symlink_to(Path("..") / "blobs" / "1f2e3d")
    code, lines = run_cli(tmp_path, capsys, monkeypatch, f"model.path={checkpoint}")
    assert code == 0, lines


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_weight_file_says_so(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (checkpoint / "model.safetensors").chmod(0)
    one_error(run_cli(tmp_path, capsys, monkeypatch, f"model.path={checkpoint}"), "cannot be opened: Permission denied")


def test_an_unreadable_weight_file_says_so_even_as_root(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a non-root user sees on a mode-000 file, for a test that may run as root.
    weights, real_open = str(checkpoint / "model.safetensors"), os.open

    def denying_open(path: object, *args: int, **kwargs: int) -> int:
        if str(path) == weights:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", denying_open)
    one_error(run_cli(tmp_path, capsys, monkeypatch, f"model.path={checkpoint}"),
              f"{weights} cannot be opened: Permission denied")


@pytest.mark.parametrize(
    ("value", "dtype", "says"),
    [
        (float("nan"), "float32", f"tensor '{TENSOR}' has NaN or infinite values"),
        (float("-inf"), "float32", f"tensor '{TENSOR}' has NaN or infinite values"),
        (1e6, "float16", f"tensor '{TENSOR}' overflows torch.float16"),
    ],
    ids=["nan", "inf", "overflow"],
)
def test_non_finite_weights_are_refused_naming_file_and_tensor(
    value: float, dtype: str, says: str, checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def poison(state: dict[str, torch.Tensor]) -> None:
        state[TENSOR][3, 4] = value

    edit_tensor(checkpoint, poison)
    one_error(run_cli(tmp_path, capsys, monkeypatch, f"model.path={checkpoint}", f"model.dtype={dtype}"),
              f"{checkpoint}/model.safetensors: ", says)


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("rms_norm_eps", float("nan"), "rms_norm_eps must be a finite number > 0 (got nan)"),
        ("rms_norm_eps", "tiny", "rms_norm_eps must be a finite number > 0 (got 'tiny')"),
        ("rope_theta", -10000.0, "rope_theta must be a finite number > 0 (got -10000.0)"),
        ("rope_theta", float("inf"), "rope_theta must be a finite number > 0 (got inf)"),
        ("head_dim", -16, "head_dim must be a positive integer (got -16)"),
    ],
    ids=["eps-nan", "eps-text", "theta-negative", "theta-inf", "head_dim-negative"],
)
def test_config_json_values_that_would_compute_garbage_are_refused(
    key: str, value: object, says: str, checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    config[key] = value
    (checkpoint / "config.json").write_text(json.dumps(config))
    one_error(run_cli(tmp_path, capsys, monkeypatch, f"model.path={checkpoint}"), f"{checkpoint}/config.json: {says}")


# The tiny checkpoint's vocabulary has 320 ids.


def edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(("key", "value"), every(2, arguments=2, cases=[
    ("tie_word_embeddings", "false"), ("attention_bias", "false"), ("mlp_bias", "no"),
    ("use_sliding_window", "true"), ("tie_word_embeddings", 0),
]))
def test_a_boolean_written_as_anything_but_true_or_false_is_refused(
    key: str, value: object, checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    edit_json(checkpoint / "config.json", **{key: value})
    one_error(run_cli(tmp_path, capsys, monkeypatch, f"model.path={checkpoint}"),
              f"{checkpoint}/config.json: {key} must be true or false (got {json.dumps(value)})")


@pytest.mark.parametrize(("scaling", "says"), every(3, arguments=2, cases=[
    ({"rope_type": "linear", "factor": 1e308}, "factor=1e+308: rope_type=linear needs a factor in [1, 10000]"),
    ({"rope_type": "linear", "factor": float("inf")}, "factor=inf: must be a finite number"),
    ({"rope_type": "linear", "factor": float("nan")}, "factor=nan: must be a finite number"),
    ({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": "4096"},
     "original_max_position_embeddings='4096': expected an integer"),
    ({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 32, "beta_fast": float("nan")},
     "beta_fast=nan: must be a finite number"),
    ({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 32, "truncate": "false"},
     "truncate='false': expected true or false"),
]))
def test_rope_scaling_beyond_any_use_is_refused(
    scaling: dict[str, object], says: str, checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    edit_json(checkpoint / "config.json", rope_scaling=scaling)
    one_error(run_cli(tmp_path, capsys, monkeypatch, f"model.path={checkpoint}"),
              f"{checkpoint}/config.json: rope_scaling.{says}")


@pytest.mark.parametrize(("where", "value", "says"), every(2, arguments=3, cases=[
    ("generation_config.json", list(range(1_000_000)), "eos_token_id 320 is not a token id of the vocabulary [0, 320)"),
    ("generation_config.json", [2, "3"], 'eos_token_id "3" is not a token id'),
    ("config.json", -5, "eos_token_id -5 is not a token id"),
    ("generation_config.json", list(range(10)) * 1000, "eos_token_id lists more than 8 distinct token ids"),
]))
def test_end_of_sequence_ids_are_checked_before_anything_is_done_with_them(
    where: str, value: object, says: str, checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hf_config, "MAX_EOS_IDS", 8)
    edit_json(checkpoint / where, eos_token_id=value)
    one_error(run_cli(tmp_path, capsys, monkeypatch, f"model.path={checkpoint}"), f"{checkpoint}/{where}: {says}")


def test_config_json_nested_beyond_reason_is_refused(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = (checkpoint / "config.json").read_text()
    (checkpoint / "config.json").write_text(config.rstrip()[:-1] + ', "deep": ' + "[" * 50_000 + "]" * 50_000 + "}")
    one_error(run_cli(tmp_path, capsys, monkeypatch, f"model.path={checkpoint}"),
              f"{checkpoint}/config.json is nested deeper than 64 levels")


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer.json"])
def test_a_fifo_in_place_of_a_json_file_is_refused_not_waited_on(name: str, checkpoint: Path, tmp_path: Path) -> None:
    (checkpoint / name).unlink(missing_ok=True)
    os.mkfifo(checkpoint / name)
    result = run_python(["-m", "corelib", *QUICK, f"model.path={checkpoint}"], cwd=tmp_path, timeout=90)
    assert result.returncode == 2, result.stderr
    assert f"{checkpoint}/{name} is a FIFO, not a regular file" in result.stderr


def test_an_index_naming_a_tensor_its_shard_lacks_is_one_line(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
    (checkpoint / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(names, "model.safetensors")}))
    def drop_lm_head(state: dict[str, torch.Tensor]) -> None:
        del state["lm_head.weight"]  # the index still says it is there

    edit_tensor(checkpoint, drop_lm_head)
    one_error(run_cli(tmp_path, capsys, monkeypatch, f"model.path={checkpoint}"),
              "puts tensor 'lm_head.weight' in model.safetensors, which has no such tensor")
