"""``python -m corelib`` in a subprocess: exit codes, one-line errors, what a run writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from support import Cli, assert_user_error, install_fixture_plugins

from corelib.config.gate_catalog import shipped_gate_files

# -- what works -------------------------------------------------------------------------------


def test_help_prints_the_usage(cli: Cli) -> None:
    result = cli("--help")
    assert result.returncode == 0
    assert result.stdout.startswith("usage: python -m corelib COMMAND")
    for command in ("run", "plan", "backends", "bench"):
        assert f"\n  {command} " in result.stdout


def test_no_command_prints_the_usage_as_an_error(cli: Cli) -> None:
    result = cli()
    assert result.returncode == 2
    assert result.stderr.startswith("usage: python -m corelib COMMAND")
    assert result.stdout == ""


@pytest.mark.slow
def test_plan_writes_the_resolved_config_and_the_plan_into_the_run_directory(
    cli: Cli, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    result = cli("plan", "backend=npu", "engine.transport=shm", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr
    assert (
        "corelib: npu: running on the stream emulator with the npu profile because torch_npu" in result.stderr
    ), "status goes to stderr"
    assert "feature plan" in result.stdout, "the plan is what the command produces: stdout"
    assert "corelib:" not in result.stdout
    config = OmegaConf.load(run_dir / "config.yaml")
    assert OmegaConf.select(config, "backend.name") == "npu"
    assert OmegaConf.select(config, "engine.transport") == "shm"
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["backend"] == "npu"
    assert plan["runtime"] == "emulated"
    assert plan["capabilities"]["pageable_h2d_is_staged"] is False
    assert set(plan["features"]) == set(shipped_gate_files()), "every gate file is in the plan"
    on = {"graph", "async_token_handoff", "shm_ordered_materialization"}
    assert all(plan["features"][name]["enabled"] for name in on)
    assert not plan["features"]["fused_ops"]["enabled"], "the emulator runs the reference ops"
    assert not plan["features"]["fast_allreduce"]["enabled"], "one rank has nothing to all-reduce"
    assert not plan["features"]["pdl"]["enabled"], "the emulator cannot launch kernels early"


@pytest.mark.slow
def test_multirun_plans_every_job_in_its_own_directory(cli: Cli, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = cli("plan", "-m", "backend=auto,npu", f"hydra.sweep.dir={sweep}")
    assert result.returncode == 0, result.stderr
    assert "backend=auto chose cpu" in result.stderr
    chosen = [OmegaConf.load(sweep / str(job) / "config.yaml").backend.name for job in (0, 1)]
    assert chosen == ["cpu", "npu"]  # config.yaml holds the backend auto chose, not "auto"
    for job in (0, 1):
        assert json.loads((sweep / str(job) / "plan.json").read_text())["features"]


def test_plan_help_lists_the_config_groups(cli: Cli) -> None:
    result = cli("plan", "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: python -m corelib plan" in result.stdout
    assert "backend: auto, cpu, cuda, mlu, npu" in result.stdout


def test_cfg_job_prints_the_composed_config_without_running(cli: Cli, tmp_path: Path) -> None:
    result = cli("plan", "backend=npu", "--cfg", "job", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr
    assert OmegaConf.create(result.stdout).backend.name == "npu"
    assert not (tmp_path / "run").exists()


def test_backends_prints_a_table_of_every_plugin(cli: Cli) -> None:
    result = cli("backends")
    assert result.returncode == 0, result.stderr
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.startswith("│ ")}
    assert {"cpu", "cuda", "npu", "mlu"} <= set(rows)
    assert "native" in rows["cpu"]
    assert "emulated" in rows["npu"]
    assert "torch_npu cannot be imported" in result.stdout


def test_backends_help(cli: Cli) -> None:
    result = cli("backends", "--help")
    assert result.returncode == 0
    assert result.stdout.startswith("usage: python -m corelib backends")


# -- bad input: exit 2, one line, no traceback ------------------------------------------------


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["plna"], ["unknown command 'plna'", "did you mean 'plan'?"]),
        (["backends", "npu"], ["backends takes no arguments (got npu)"]),
        (["plan", "backend=tpu"], ["backend=tpu: no such option; available: auto, cpu, cuda, mlu, npu"]),
        (["plan", "engine.grahp=on"], ["engine.grahp", "did you mean 'graph'?"]),
        (["plan", "+engine.grahp=on"], ["engine.grahp: not a config key", "did you mean 'graph'?"]),
        (["plan", "engine.async_token_handoff=maybe"], ["engine.async_token_handoff", "auto, on, off"]),
        (["plan", "workload.num_requests=many"], ["workload.num_requests", "many"]),
        (["plan", "engine.graph=["], ["cannot parse the override 'engine.graph=['"]),
        (["plan", "--cfg", "job", "engine.grahp=on"], ["engine.grahp", "did you mean 'graph'?"]),
        (["plan", "-m", "engine.graph=maybe"], ["engine.graph", "auto, on, off"]),
        (
            ["plan", "backend=npu", "backend.runtime=native"],
            ["backend.runtime=native refused: torch_npu cannot be imported"],
        ),
        (["plan", "+engine._target_=os.system"], ["engine._target_: _target_ 'os.system' is refused"]),
        (["bench", "backend=cpu", "bench.top_p=0"], ["bench.top_p=0.0: must be in (0, 1]"]),
        (
            ["plan", "backend=npu", "plugins.block=[npu]"],
            ["plugin 'npu' is not loaded (blocked by plugins.block)"],
        ),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) and value[0] != "did" else None,
)
def test_a_bad_input_is_one_line_and_exit_2(cli: Cli, args: list[str], fragments: list[str]) -> None:
    assert_user_error(cli(*args), *fragments)


@pytest.mark.slow
def test_on_for_a_feature_the_backend_cannot_do_lists_every_unmet_requirement(cli: Cli) -> None:
    result = cli("plan", "backend=cpu", "engine.async_token_handoff=on")
    assert_user_error(
        result,
        "engine.async_token_handoff=on refused: the device has no independent streams",
        "engine.async_token_handoff=on refused: the device has no asynchronous device-to-host copy",
        "engine.async_token_handoff=on refused: the device cannot allocate pinned host memory",
        "engine.async_token_handoff=on refused: graphs are disabled",
        lines=4,
    )


@pytest.mark.slow
def test_a_failing_job_of_a_multirun_is_named(cli: Cli, tmp_path: Path) -> None:
    result = cli("plan", "-m", "backend=cpu,npu", "engine.graph=on", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert_user_error(result, "job [backend=cpu engine.graph=on]: engine.graph=on refused", lines=2)
    assert (tmp_path / "sweep" / "1" / "plan.json").exists()  # the npu job still ran


def test_full_error_shows_the_traceback(cli: Cli) -> None:
    result = cli("plan", "engine.grahp=on", env={"HYDRA_FULL_ERROR": "1"})
    assert result.returncode != 0
    assert "Traceback (most recent call last)" in result.stderr
    assert "engine.grahp" in result.stderr


# -- bad input from a plugin ------------------------------------------------------------------


def test_a_misspelled_capability_in_a_backend_yaml(cli: Cli, tmp_path: Path) -> None:
    path = install_fixture_plugins(tmp_path / "site", "badcaps")
    result = cli("plan", "backend=badcaps", pythonpath=path)
    assert_user_error(result, "backend.capabilities.graph: not a capability", "did you mean 'graphs'?")


def test_selecting_a_plugin_that_failed_to_load(cli: Cli, tmp_path: Path) -> None:
    path = install_fixture_plugins(tmp_path / "site", "broken")
    result = cli("plan", "backend=broken", pythonpath=path)
    assert_user_error(
        result, "plugin 'broken'", "failed to load", "libtoy.so: cannot open shared object file"
    )
