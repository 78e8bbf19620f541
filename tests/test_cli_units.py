"""The CLI's own logic, in process: argument order, plugin keys, Ctrl-C, failed sweeps."""

from __future__ import annotations

import pytest

from corelib.cli import hydra_app
from corelib.cli import main as cli
from corelib.errors import ConfigError, CorelibError


@pytest.mark.parametrize(
    ("args", "overrides", "flags"),
    [
        (["a=1", "--cfg", "job", "b=2"], ["a=1", "b=2"], ["--cfg", "job"]),
        (["--info", "a=1"], ["a=1"], ["--info"]),  # a bare --info takes no override as its value
        (["a=1", "--info", "defaults"], ["a=1"], ["--info", "defaults"]),
        (["-m", "a=1,2", "--cfg=job", "~b"], ["a=1,2", "~b"], ["-m", "--cfg=job"]),
        (["-cd", "/my/conf", "model=mine"], ["model=mine"], ["-cd", "/my/conf"]),
    ],
)
def test_flags_and_overrides_may_come_in_any_order(
    args: list[str], overrides: list[str], flags: list[str]
) -> None:
    assert hydra_app.split_arguments(args) == (overrides, flags)


@pytest.mark.parametrize(
    ("overrides", "allow", "block"),
    [
        ([], None, []),
        (["plugins.allow=[cpu,npu]", "backend=npu"], ["cpu", "npu"], []),
        (["plugins.block=[cuda]"], None, ["cuda"]),
        (["plugins.allow=null"], None, []),
        (["plugins.allow=[cpu],[npu]"], None, []),  # a sweep is left to the per-job check
        (["engine.graph=["], None, []),  # a bad override is reported by composing
    ],
)
def test_plugin_keys_are_read_from_the_overrides_before_plugins_load(
    overrides: list[str], allow: list[str] | None, block: list[str]
) -> None:
    assert hydra_app.plugin_restrictions(overrides) == (allow, block)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cfg"], "--cfg needs a value"),
        (["--cfg", "-m"], "--cfg needs a value"),
        (["--frobnicate", "a=1"], "unknown flag --frobnicate"),
        (["--cfgg=job"], "unknown flag --cfgg"),
    ],
)
def test_a_malformed_flag_is_one_line(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        hydra_app.split_arguments(args)


def test_ctrl_c_exits_130(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(command: str, rest: list[str]) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_hydra_command", interrupted)
    assert cli.main(["plan"]) == 130
    assert capsys.readouterr().err == "corelib: interrupted\n"


def test_a_sweep_with_failed_jobs_exits_with_the_worst_code() -> None:
    failures = [("backend=cpu", ConfigError("bad\nworse")), ("backend=npu", CorelibError("device lost"))]
    error = hydra_app.JobsFailed(failures)
    assert error.exit_code == 2
    assert str(error).splitlines() == [
        "job [backend=cpu]: bad",
        "job [backend=cpu]: worse",
        "job [backend=npu]: device lost",
    ]
