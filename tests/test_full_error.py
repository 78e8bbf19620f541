"""``HYDRA_FULL_ERROR=1`` adds the traceback and changes nothing else: the same last line, the same exit code."""

from __future__ import annotations

from support import Cli


def test_full_error_keeps_the_exit_code_of_a_bad_config(cli: Cli) -> None:
    plain = cli("plan", "engine.grahp=on")
    full = cli("plan", "engine.grahp=on", env={"HYDRA_FULL_ERROR": "1"})
    assert (plain.returncode, full.returncode) == (2, 2), full.stderr
    assert "Traceback (most recent call last)" in full.stderr
    assert full.error_lines[-1] == plain.error_lines[-1]
    assert full.error_lines[-1].startswith("corelib: error: engine.grahp: Key 'grahp' not in 'EngineConfig'")


def test_full_error_keeps_the_exit_code_of_a_runtime_failure(cli: Cli) -> None:
    args = ("run", "backend=cpu", "workload.num_requests=1", "engine.timeout_s=1")
    full = cli(*args, env={"HYDRA_FULL_ERROR": "1", "CORELIB_FAULTS": "forward@2"})
    assert full.returncode == 1, full.stderr
    assert "Traceback (most recent call last)" in full.stderr
    assert full.error_lines[-1].startswith("corelib: error: InjectedFault: injected fault at 'forward'")
