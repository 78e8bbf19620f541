"""``hydra.output_subdir`` stays inside the run directory, whoever sets it.

Hydra writes its copy of the config (``config.yaml``, ``hydra.yaml``, ``overrides.yaml``) into
the run directory joined with ``hydra.output_subdir``. A config file may not set it at all
(``tests/reliability/test_hostile_configs.py``); the command line may, but a value that climbs
out with ``..``, an absolute path, or a symlink on the way would put those files, or overwrite
them, anywhere. Each is refused with one line naming the key (exit 2) before Hydra writes
anything: the directory the run starts in holds what it held before.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import Cli, assert_user_error

QUICK = ("backend=cpu", "workload.num_requests=1", "workload.output_len_min=2", "workload.output_len_max=2",
         "engine.max_num_seqs=2", "model.max_model_len=64")
KEEP = "keep\n"


@pytest.fixture
def victims(tmp_path: Path) -> Path:
    (tmp_path / "victim-dir").mkdir()
    (tmp_path / "victim-dir" / "config.yaml").write_text(KEEP)
    return tmp_path


def files_under(where: Path) -> set[str]:
    return {str(path.relative_to(where)) for path in where.rglob("*")}


@pytest.mark.parametrize("subdir", ["../../../victim-dir", "../../..", "a/../../b", "{tmp_path}/elsewhere"])
def test_an_output_subdir_that_leaves_the_run_directory_is_refused_before_anything_is_written(
    subdir: str, cli: Cli, victims: Path
) -> None:
    before = files_under(victims)
    subdir = subdir.format(tmp_path=victims)
    result = cli("run", *QUICK, f"hydra.output_subdir={subdir}")
    assert_user_error(result, f"hydra.output_subdir: refused: {subdir[:80]!r} leaves the run directory")
    assert (victims / "victim-dir" / "config.yaml").read_text() == KEEP
    assert files_under(victims) == before, "something was written"


def test_an_output_subdir_that_cannot_be_resolved_yet_is_refused(cli: Cli, victims: Path) -> None:
    before = files_under(victims)
    result = cli("run", *QUICK, "hydra.output_subdir=${oc.env:CORELIB_NOT_SET_ANYWHERE}")
    assert_user_error(result, "hydra.output_subdir: refused: '${oc.env:CORELIB_NOT_SET_ANYWHERE}' cannot be resolved")
    assert files_under(victims) == before, "something was written"


def test_a_symlink_on_the_way_to_the_output_subdir_is_not_followed(cli: Cli, victims: Path) -> None:
    run_dir = victims / "shared-run"
    run_dir.mkdir()
    (run_dir / "sub").symlink_to(victims / "victim-dir")
    result = cli("run", *QUICK, f"hydra.run.dir={run_dir}", "hydra.output_subdir=sub/meta")
    assert_user_error(result, "hydra.output_subdir: refused", f"{run_dir / 'sub'} is a symlink")
    assert files_under(victims / "victim-dir") == {"config.yaml"}


def test_an_output_subdir_inside_the_run_directory_is_where_hydra_writes(cli: Cli, victims: Path) -> None:
    run_dir = victims / "run"
    result = cli("plan", *QUICK, f"hydra.run.dir={run_dir}", "hydra.output_subdir=meta/../hydra-copy")
    assert result.returncode == 0, result.stderr
    assert {"config.yaml", "hydra.yaml", "overrides.yaml"} <= {p.name for p in (run_dir / "hydra-copy").iterdir()}
    assert files_under(victims / "victim-dir") == {"config.yaml"}
