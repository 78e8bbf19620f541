"""A worker process runs corelib's code whatever the environment became after start.

Something that rewrites ``os.environ`` inside a running corelib (Hydra's ``env_set`` did, from
a config file) must not reach the worker: ``PYTHONPATH`` with a ``sitecustomize.py``, an
``LD_PRELOAD``. The variables that only choose devices, ranks or corelib's switches still do.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from corelib.engine import Engine, SamplingParams
from corelib.trust import isolation

SITECUSTOMIZE = "from pathlib import Path\nPath({marker!r}).write_text('imported')\n"


def hostile_site(tmp_path: Path) -> tuple[Path, Path]:
    site, marker = tmp_path / "hostile-site", tmp_path / "hostile-ran"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(marker=str(marker)))
    return site, marker


@pytest.mark.slow
def test_a_pythonpath_set_after_start_does_not_reach_a_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site, marker = hostile_site(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(site))
    with Engine.from_overrides(["backend=cpu", "engine.transport=shm", "engine.max_num_seqs=2",
                                "engine.graph=off"]) as engine:
        [output] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert not marker.exists(), "the worker imported a sitecustomize.py from a PYTHONPATH set after start"
    assert len(output.output_token_ids) == 4, "the run did not complete"


def test_the_worker_environment_is_the_startup_one_but_for_runtime_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isolation, "_STARTUP_ENVIRONMENT",
                        {"HOME": "/home/me", "LD_PRELOAD": "", "PYTHONPATH": "/startup", "CUDA_VISIBLE_DEVICES": "0"})
    monkeypatch.setenv("LD_PRELOAD", "/tmp/hostile.so")
    monkeypatch.setenv("PYTHONSTARTUP", "/tmp/hostile.py")
    monkeypatch.setenv("NCCL_NET_PLUGIN", "hostile")
    monkeypatch.setenv("CORELIB_FAULTS", "forward@3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    env = isolation.worker_environment()
    assert env["LD_PRELOAD"] == "", "a variable that loads code changed after start and reached the worker"
    assert "NCCL_NET_PLUGIN" not in env
    assert not [name for name in env if name.startswith("PYTHON")]
    assert env["HOME"] == "/home/me"
    assert (env["CORELIB_FAULTS"], env["CUDA_VISIBLE_DEVICES"], env["MASTER_PORT"]) == ("forward@3", "1", "29555")


def test_the_worker_interpreter_is_isolated_and_gets_this_sys_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site, marker = hostile_site(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "probe_isolation.py").write_text("import sys\nprint(sys.flags.isolated, sys.path[0])\n")
    monkeypatch.syspath_prepend(str(mine))
    env = {**isolation.worker_environment(), "PYTHONPATH": str(site)}  # even if one slipped through
    done = subprocess.run(isolation.worker_command("probe_isolation"), env=env, cwd=site, capture_output=True,
                          text=True, check=False, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", str(mine)]
    assert not marker.exists()
    assert sys.path[0] == str(mine)


def test_a_worker_on_a_device_that_is_the_host_leaves_a_core_to_the_scheduler() -> None:
    from corelib.transport.worker import compute_threads

    assert compute_threads(2, 1, device_is_host=True) == 1, "the scheduler packs the next step on the other core"
    assert compute_threads(16, 2, device_is_host=True) == 7
    assert compute_threads(16, 2, device_is_host=False) == 8, "an accelerator's workers keep every core"
    assert compute_threads(1, 1, device_is_host=True) == 1


def test_a_worker_for_an_accelerator_serves_steps_on_one_host_thread() -> None:
    from corelib.transport.worker import serving_threads

    assert serving_threads(16, on_host=False) == 1, "a woken pool spins beside the thread that reads frames"
    assert serving_threads(7, on_host=True) == 7, "the host computes the steps: its pool stays"
