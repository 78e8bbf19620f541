"""Config files from a shared directory that try to run code or write files through Hydra.

Each case is a real config on ``hydra.searchpath`` (``tests/fixtures/hostile``), run through
``python -m corelib run`` in a directory holding what the attack aims at: ``victim.txt`` (to be
truncated or replaced), ``victim-dir/config.yaml`` (to be overwritten) and ``hostile-site/``
with a ``sitecustomize.py`` that leaves a marker when any Python process imports it. corelib
must refuse each one with one line naming the key (exit 2), before Hydra acts on it: the
victims stay as they were and the marker never appears.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import FIXTURES, Cli, assert_user_error, every

HOSTILE = FIXTURES / "hostile"
SEARCHPATH = f"hydra.searchpath=[file://{HOSTILE}]"
QUICK = ("backend=cpu", "workload.num_requests=2", "workload.output_len_min=2", "workload.output_len_max=4",
         "engine.max_num_seqs=2", "model.max_model_len=64")
KEEP = "keep\n"
SITECUSTOMIZE = 'import os\nopen(os.path.join(os.getcwd(), "hostile-ran"), "w").write("imported")\n'


@dataclass(frozen=True)
class Attack:
    overrides: tuple[str, ...]
    says: str  # the key the one error line must name, and why


ATTACKS = {
    # an SHM worker would import hostile-site/sitecustomize.py
    "env-pythonpath": Attack(("workload=env_pythonpath", "engine.transport=shm"),
                             "hydra.job.env_set.PYTHONPATH: refused: a config may not set environment variables"),
    "env-ld-preload": Attack(("workload=env_ld_preload", "engine.transport=shm"),
                             "hydra.job.env_set.LD_PRELOAD: refused"),
    "callback-open-truncates": Attack(("workload=callback_truncate",),
                                      "hydra.callbacks.truncate: refused: Hydra callbacks run code"),
    "callback-copyfile-replaces": Attack(("workload=callback_copy",), "hydra.callbacks.copy: refused"),
    "job-logging-file-handler": Attack(("workload=job_log_truncate",),
                                       "hydra.job_logging.handlers.file.filename: refused: 'victim.txt': a log "
                                       "file must be directly inside the run directory"),
    "hydra-logging-file-handler": Attack(("workload=hydra_log_truncate",),
                                         "hydra.hydra_logging.handlers.file.class: refused"),
    "logging-factory": Attack(("workload=log_factory",),
                              "hydra.job_logging.handlers.file.(): refused: logging factories and properties run code"),
    "logging-option-from-searchpath": Attack(("hydra/job_logging=truncate",),
                                             "hydra.job_logging.handlers.file.filename: refused"),
    "launcher-target": Attack(("workload=launcher_truncate",),
                              "hydra.launcher._target_: refused: 'builtins.open': only Hydra's basic launcher"),
    "sweeper-target": Attack(("workload=sweeper_truncate",),
                             "hydra.sweeper._target_: refused: 'builtins.open': only Hydra's basic sweeper"),
    "sweep-params-env": Attack(("workload=sweep_params_env", "engine.transport=shm"),
                               "hydra.sweeper.params.+hydra.job.env_set.PYTHONPATH: refused: a sweep may vary the "
                               "task's keys, not Hydra's"),
    "sweep-picks-a-hostile-option": Attack(("-m", "workload=default,env_pythonpath", "engine.transport=shm"),
                                           "hydra.job.env_set.PYTHONPATH: refused"),
    "overrides-injected": Attack(("workload=overrides_injected", "engine.transport=shm"),
                                 "hydra.overrides: refused: overrides come from the command line only"),
    "output-subdir-escapes": Attack(("workload=output_subdir",), "hydra.output_subdir: refused"),
    # hydra.runtime.output_dir pointed elsewhere, then a log file "inside the run directory" there
    "runtime-output-dir-then-hydra-log": Attack(("workload=runtime_bashrc",),
                                                "hydra.runtime.output_dir: refused: 'victim-dir': Hydra sets it"),
    "runtime-output-dir-then-job-log": Attack(("workload=runtime_job_log",), "hydra.runtime.output_dir: refused"),
    "runtime-output-dir-from-config-dir": Attack(("-cd", str(HOSTILE), "workload=runtime_bashrc"),
                                                 "hydra.runtime.output_dir: refused"),
    "runtime-output-dir-on-the-command-line": Attack(("hydra.runtime.output_dir=victim-dir",),
                                                     "hydra.runtime.output_dir: refused"),
    "hydra-logging-writes-a-file": Attack(("workload=hydra_log_in_run_dir",),
                                          "hydra.hydra_logging.handlers.file.class: refused: Hydra's own logging "
                                          "starts before the run directory exists"),
    "log-file-not-a-log": Attack(("workload=log_not_a_log",), "hydra.job_logging.handlers.file.filename: refused"),
}


@pytest.fixture
def victims(tmp_path: Path) -> Path:
    (tmp_path / "victim.txt").write_text(KEEP)
    (tmp_path / "victim-dir").mkdir()
    (tmp_path / "victim-dir" / "config.yaml").write_text(KEEP)
    (tmp_path / "hostile-site").mkdir()
    (tmp_path / "hostile-site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return tmp_path


def assert_unharmed(where: Path) -> None:
    assert (where / "victim.txt").read_text() == KEEP, "victim.txt was changed"
    assert (where / "victim-dir" / "config.yaml").read_text() == KEEP, "victim-dir/config.yaml was overwritten"
    assert sorted(p.name for p in (where / "victim-dir").iterdir()) == ["config.yaml"], "files landed in victim-dir"
    assert not (where / "hostile-ran").exists(), "a process imported the hostile sitecustomize.py"


@pytest.mark.parametrize("name", every(3, list(ATTACKS)))
def test_a_hostile_config_is_refused_before_hydra_acts_on_it(name: str, cli: Cli, victims: Path) -> None:
    attack = ATTACKS[name]
    result = cli("run", *QUICK, SEARCHPATH, *attack.overrides)
    assert_user_error(result, attack.says)
    assert_unharmed(victims)


@pytest.mark.parametrize("planted", ["run.log", ".hydra", ".hydra/config.yaml"])
def test_a_symlink_planted_in_an_existing_run_directory_is_not_followed(planted: str, cli: Cli, victims: Path) -> None:
    run_dir = victims / "shared-run"
    (run_dir / ".hydra").mkdir(parents=True)
    link = run_dir / planted
    if link.is_dir():
        link.rmdir()
    link.symlink_to(victims / ("victim-dir" if planted == ".hydra" else "victim.txt"))
    result = cli("run", *QUICK, f"hydra.run.dir={run_dir}")
    assert_user_error(result, f"{link} is a symlink", "choose a new directory with hydra.run.dir=")
    assert_unharmed(victims)


@pytest.mark.parametrize("planted", every(3, ["outputs.jsonl", ".config.yaml.partial", ".plan.json.partial",
                                               ".metrics.json.partial", "config.yaml", "metrics.json"]))
def test_corelibs_own_files_are_never_written_through_a_planted_symlink(planted: str, cli: Cli,
                                                                        victims: Path) -> None:
    run_dir = victims / "shared-run"
    run_dir.mkdir()
    (run_dir / planted).symlink_to(victims / "victim.txt")
    result = cli("run", *QUICK, f"hydra.run.dir={run_dir}")
    if planted == "outputs.jsonl":  # appended to as requests finish: refused
        assert_user_error(result, f"cannot write {run_dir / planted}: it is a symlink", code=1)
    else:  # written beside the name and renamed over it: the link is replaced, its target untouched
        assert result.returncode == 0, result.stderr
        assert not (run_dir / planted).is_symlink()
    assert_unharmed(victims)


def test_a_fifo_planted_for_the_outputs_is_refused_without_blocking(cli: Cli, victims: Path) -> None:
    run_dir = victims / "shared-run"
    run_dir.mkdir()
    os.mkfifo(run_dir / "outputs.jsonl")
    result = cli("run", *QUICK, f"hydra.run.dir={run_dir}")
    assert_user_error(result, f"cannot write {run_dir / 'outputs.jsonl'}: it is a FIFO", code=1)


@pytest.mark.parametrize(
    "overrides",
    every(2, [
        ("hydra/job_logging=stdout", "hydra/hydra_logging=disabled"),
        ("hydra/job_logging=none", "hydra/hydra_logging=none"),
        ("hydra/job_logging=disabled", "hydra.job_logging.root.level=WARNING"),
        ("hydra.run.dir=given-on-the-command-line",),
        ("hydra.job.env_copy=[HOME]",),  # copies the current value: changes nothing
    ]),
)
def test_hydra_settings_that_run_no_code_still_work(overrides: tuple[str, ...], cli: Cli, victims: Path) -> None:
    result = cli("plan", *QUICK, SEARCHPATH, *overrides)
    assert result.returncode == 0, result.stderr
    assert_unharmed(victims)


def test_a_shared_config_may_still_set_the_task_keys(cli: Cli, tmp_path: Path) -> None:
    shared = tmp_path / "shared" / "workload"
    shared.mkdir(parents=True)
    (shared / "mine.yaml").write_text("defaults:\n  - default\n  - _self_\nnum_requests: 3\n")
    result = cli("plan", "backend=cpu", f"hydra.searchpath=[file://{shared.parent}]", "workload=mine", "--cfg", "job")
    assert result.returncode == 0, result.stderr
    assert "num_requests: 3" in result.stdout


# The operator's settings: a shared config may not open the server, turn its key off, name it
# after the environment or send the key elsewhere. Checked as composed, so `plan` shows it for
# `serve` and `bench-serve` too (the same check guards every command).
SECRET = "hostile-secret-value"
GATES = "features=[graph,async_token_handoff,shm_ordered_materialization,fused_ops,fast_allreduce,pdl,no_key]"
OPERATOR_ATTACKS = {
    "server-option-drops-the-key": Attack(("server=no_key",), "server.api_key: refused: null: the server's address, "
                                                              "API key and model name are the operator's"),
    "gate-drops-the-key": Attack((GATES,), "server.api_key: refused: null"),
    "server-option-listens-everywhere": Attack(("server=every_interface",), "server.host: refused: '0.0.0.0'"),
    "bench-sends-the-key-elsewhere": Attack(("server=bench_elsewhere",), "server.bench.url: refused"),
    "served-name-from-the-environment": Attack(("server=named_after_env",), "server.served_model_name: refused"),
    "model-name-from-the-environment": Attack(("workload=env_model_name",),
                                              "model.name: refused: '${oc.env:HOSTILE_SECRET,unset}': a config file "
                                              "may not read the environment"),
    "model-name-copies-the-key": Attack(("workload=key_in_model_name",),
                                        "model.name: refused: '${server.api_key}': a config file may not copy the "
                                        "API key"),
    "sweep-drops-the-key": Attack(("-m", "workload=sweep_no_key"),
                                  "hydra.sweeper.params.server.api_key: refused: 'null': a sweep"),
}


@pytest.mark.parametrize("name", every(3, list(OPERATOR_ATTACKS)))
def test_a_shared_config_cannot_change_the_operators_server_settings(name: str, cli: Cli, tmp_path: Path) -> None:
    attack = OPERATOR_ATTACKS[name]
    env = {"CORELIB_API_KEY": SECRET, "HOSTILE_SECRET": SECRET}
    result = cli("plan", *QUICK, SEARCHPATH, *attack.overrides, env=env)
    assert_user_error(result, attack.says)
    assert not (tmp_path / "outputs").exists(), "a run directory was written"


@pytest.mark.parametrize("overrides", [
    ("server.host=0.0.0.0", "server.port=8080", "server.served_model_name=mine"),
    ("server=no_key", "server.api_key=null"),  # the command line may choose no key
    ("model.name=${oc.env:HOSTILE_SECRET,unset}",),  # the shell could pass the value itself
])
def test_the_command_line_still_sets_them(overrides: tuple[str, ...], cli: Cli) -> None:
    result = cli("plan", *QUICK, SEARCHPATH, *overrides, "--cfg", "job", env={"HOSTILE_SECRET": SECRET})
    assert result.returncode == 0, result.stderr


def test_the_api_key_never_reaches_the_run_directory(cli: Cli, tmp_path: Path) -> None:
    result = cli("plan", *QUICK, env={"CORELIB_API_KEY": SECRET})
    assert result.returncode == 0, result.stderr
    config = next((tmp_path / "outputs").rglob("config.yaml")).parent / "config.yaml"
    written = [p for p in (tmp_path / "outputs").rglob("*") if p.is_file() and SECRET in p.read_text()]
    assert not written, f"the key is in {written}"
    assert config.read_text().count("api_key: <set>") == 2, config.read_text()
