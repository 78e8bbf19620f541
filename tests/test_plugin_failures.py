"""One bad plugin never breaks the others: whatever it raises, or whatever name it takes.

Each broken plugin is installed as its own distribution beside the built-in ones; ``backends``
still lists everything (the broken one with its reason), other backends still run, and
selecting the broken one is one line (exit 2). A real Ctrl-C or SIGTERM during a slow plugin
import still stops corelib.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import (
    HERMETIC_VARIABLES,
    PLUGIN_FIXTURES,
    Cli,
    assert_user_error,
    install_fixture_plugins,
    write_dist_info,
)

QUICK_RUN = ("run", "backend=cpu", "workload.num_requests=1", "workload.output_len_min=2",
             "workload.output_len_max=2", "engine.max_num_seqs=1", "model.max_model_len=32")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("plugin", "reason"),
    [
        ("exits", "import of corelib_oddities.exits failed: SystemExit: 3"),
        ("interrupts", "import of corelib_oddities.interrupts failed: KeyboardInterrupt"),
        ("hook_exits", "hook corelib_backends raised SystemExit: hook gave up"),
    ],
)
def test_a_plugin_that_raises_anything_is_listed_and_skipped(plugin: str, reason: str, cli: Cli,
                                                             tmp_path: Path) -> None:
    path = install_fixture_plugins(tmp_path / "site", plugin)
    listed = cli("backends", pythonpath=path)
    assert listed.returncode == 0, listed.stderr
    assert plugin in listed.stdout and "failed" in listed.stdout
    assert reason in " ".join(listed.stdout.split())
    assert_user_error(cli("plan", f"backend={plugin}", pythonpath=path), f"plugin {plugin!r}", "failed to load")


@pytest.mark.slow
def test_run_works_beside_every_broken_plugin_at_once(cli: Cli, tmp_path: Path) -> None:
    path = install_fixture_plugins(tmp_path / "site", "exits", "interrupts", "hook_exits", "broken")
    result = cli(*QUICK_RUN, pythonpath=path)
    assert result.returncode == 0, result.stderr


def impostor(site: Path) -> list[Path]:
    """A third-party distribution whose entry point is named like the built-in cpu plugin."""
    write_dist_info(site, "corelib-impostor", {"corelib.backends": {"cpu": "corelib_oddities.second_cpu"}})
    return [site, PLUGIN_FIXTURES]


@pytest.mark.slow
def test_an_entry_point_named_like_a_builtin_breaks_only_that_name(cli: Cli, tmp_path: Path) -> None:
    path = impostor(tmp_path / "site")
    listed = cli("backends", pythonpath=path)
    assert listed.returncode == 0, listed.stderr
    flat = " ".join(listed.stdout.split())
    assert "2 installed distributions register plugin 'cpu'" in flat
    assert "corelib-impostor" in flat
    assert cli("plan", "backend=npu", pythonpath=path).returncode == 0
    assert_user_error(cli("plan", "backend=cpu", pythonpath=path), "2 installed distributions register plugin 'cpu'",
                      "uninstall all but one")


def test_blocking_the_shared_name_blocks_both(cli: Cli, tmp_path: Path) -> None:
    path = impostor(tmp_path / "site")
    listed = cli("backends", pythonpath=path, env={"CORELIB_BLOCK_PLUGINS": "cpu"})
    assert listed.returncode == 0, listed.stderr
    assert "blocked by CORELIB_BLOCK_PLUGINS" in " ".join(listed.stdout.split())


@pytest.mark.parametrize(("signum", "code", "says"), [(signal.SIGINT, 130, "corelib: interrupted"),
                                                      (signal.SIGTERM, 143, "corelib: terminated (SIGTERM)")])
@pytest.mark.slow
def test_a_real_signal_during_a_slow_plugin_import_still_stops_corelib(signum: int, code: int, says: str,
                                                                        tmp_path: Path) -> None:
    marker = tmp_path / "importing"
    path = install_fixture_plugins(tmp_path / "site", "sleeps")
    env = {k: v for k, v in os.environ.items() if k not in HERMETIC_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, path), env.get("PYTHONPATH", "")])
    env["CORELIB_TEST_MARKER"] = str(marker)
    process = subprocess.Popen([sys.executable, "-m", "corelib", "backends"], cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        assert marker.exists(), "the slow plugin was never imported"
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == code, stderr
    assert says in stderr
