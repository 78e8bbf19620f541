"""benchmarks/engine_ab.sh: the engine's TPOT under two trees in one run, each run importing its own tree, and under
a changed kernel tuning (LABEL=DIR@JSON)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from support import BENCHMARKS

REPO = BENCHMARKS.parent


@pytest.mark.slow
def test_each_tree_runs_the_bench_from_its_own_code_and_the_table_names_both(tmp_path: Path) -> None:
    tree = tmp_path / "tree"  # another tree of the same code: links to this checkout's packages
    tree.mkdir()
    for name in ("corelib", "backends", "conf"):
        (tree / name).symlink_to(REPO / name)
    env = {**os.environ, "DEVICE": "backend=npu", "MODELS": "tiny", "BATCH": "1", "ROUNDS": "1", "CAP": "240"}
    out = tmp_path / "out"
    tuned = f'{tree}@{{"gemv_max_m": 3, "gemm_shape_tiles": [[8, 64, 64, 64, 2, 4]]}}'
    done = subprocess.run(["bash", str(BENCHMARKS / "engine_ab.sh"), str(out), "here=.", f"there={tree}",
                           f"tuned={tuned}"], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    header, row = done.stdout.strip().splitlines()[-2:]
    assert header.split()[-3:] == ["here", "there", "tuned"] and row.split()[:2] == ["tiny", "1"]
    assert "(" in row.split()[-1], f"the other trees' TPOT is given against the first's: {row}"
    assert (out / "here-tiny-1.log").read_text().splitlines()[0] == f"corelib from {REPO}/corelib/__init__.py"
    assert (out / "there-tiny-1.log").read_text().splitlines()[0] == f"corelib from {tree}/corelib/__init__.py"
    tuned_log = (out / "tuned-tiny-1.log").read_text().splitlines()
    assert tuned_log[0] == f"corelib from {tree}/corelib/__init__.py"
    assert "tuning: {'gemv_max_m': 3, 'gemm_shape_tiles': ((8, 64, 64, 64, 2, 4),)}" in tuned_log
    assert "tuning:" not in (out / "there-tiny-1.log").read_text()


def test_a_label_that_the_table_cannot_split_is_refused_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(BENCHMARKS / "engine_ab.sh"), str(tmp_path), "my-tree=."],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "my-tree" in done.stderr
