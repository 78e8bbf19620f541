"""A broken vendor install must not break corelib.

torch_npu installed without the CANN libraries registers itself in torch's device-backend
entry-point group ``torch.backends``, so a plain ``import torch`` imports it and fails.
corelib turns that autoload off (unless the user chose) and imports the extension inside the
npu plugin's probe, where the failure becomes the reason npu is not native.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import BROKEN_VENDOR, Cli, assert_user_error, run_python, write_dist_info

pytestmark = pytest.mark.slow

CAUSE = "libhccl.so: cannot open shared object file"


@pytest.fixture
def broken_torch_npu(tmp_path: Path) -> list[Path]:
    """A PYTHONPATH on which torch_npu is installed, registered for autoload, and broken."""
    site = write_dist_info(
        tmp_path / "site",
        "torch-npu",
        {"torch.backends": {"torch_npu": "torch_npu:_autoload"}},
        version="2.6.0",
    )
    return [site, BROKEN_VENDOR]


def test_plain_import_torch_fails_there(tmp_path: Path, broken_torch_npu: list[Path]) -> None:
    result = run_python(["-c", "import torch"], cwd=tmp_path, pythonpath=broken_torch_npu)
    assert result.returncode != 0
    assert "Failed to load the backend extension: torch_npu" in result.stderr
    assert CAUSE in result.stderr


def test_backends_lists_npu_with_the_real_cause(cli: Cli, broken_torch_npu: list[Path]) -> None:
    result = cli("backends", pythonpath=broken_torch_npu)
    assert result.returncode == 0, result.stderr
    npu_rows = [line for line in result.stdout.splitlines() if line.startswith("│ npu ")]
    assert npu_rows and "emulated" in npu_rows[0]
    assert f"OSError: {CAUSE}" in result.stdout


def test_plan_on_npu_runs_emulated_and_says_why(
    cli: Cli, tmp_path: Path, broken_torch_npu: list[Path]
) -> None:
    result = cli("plan", "backend=npu", f"hydra.run.dir={tmp_path / 'run'}", pythonpath=broken_torch_npu)
    assert result.returncode == 0, result.stderr
    expected = "npu: running on the stream emulator with the npu profile because torch_npu cannot be imported"
    assert f"{expected} (OSError: {CAUSE}" in result.stderr


def test_importing_corelib_before_torch_protects_a_script(
    tmp_path: Path, broken_torch_npu: list[Path]
) -> None:
    script = (
        "import corelib, torch, os; print(torch.__version__, os.environ['TORCH_DEVICE_BACKEND_AUTOLOAD'])"
    )
    result = run_python(["-c", script], cwd=tmp_path, pythonpath=broken_torch_npu)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[1] == "0"


def test_autoload_chosen_by_the_user_is_kept_and_fails_in_one_line(
    cli: Cli, broken_torch_npu: list[Path]
) -> None:
    result = cli(
        "plan", "backend=npu", pythonpath=broken_torch_npu, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"}
    )
    assert_user_error(
        result,
        "torch cannot be imported: RuntimeError: Failed to load the backend extension: torch_npu",
        f"caused by OSError: {CAUSE}",
        "TORCH_DEVICE_BACKEND_AUTOLOAD=1",
        code=1,
    )
