"""Tests for hardware this machine lacks are deselected at collection and counted, not skipped one by one."""

from __future__ import annotations

import pytest

from corelib.testing.plugin import hardware_summary

pytest_plugins = ["pytester"]

MODULE = """
import pytest

@pytest.mark.gpu
def test_on_a_gpu():
    raise AssertionError("deselected tests never run")

@pytest.mark.npu
@pytest.mark.parametrize("n", [1, 2])
def test_on_an_npu(n):
    raise AssertionError("deselected tests never run")

def test_anywhere():
    pass
"""


@pytest.mark.slow
def test_absent_hardware_is_deselected_and_counted(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    from corelib.testing import plugin

    # Whatever this machine has: here, no GPU and no NPU (the run is in this process, so the plugin sees it).
    monkeypatch.setattr(plugin, "_absent_hardware", lambda registry: ({"gpu": "cuda", "npu": "npu"}, set()))
    pytester.makepyfile(test_hardware=MODULE)
    result = pytester.runpytest_inprocess("-p", "corelib.testing.plugin", "-p", "no:cacheprovider", "-n", "0", "-ra")
    result.assert_outcomes(passed=1, deselected=3)
    result.stdout.fnmatch_lines(["corelib: deselected 3 tests that need hardware absent here: 1 need a GPU, "
                                 "2 need an NPU"])
    assert "SKIPPED" not in result.stdout.str()


def test_the_summary_reads_as_a_sentence() -> None:
    from collections import Counter

    assert hardware_summary(Counter()) is None
    assert hardware_summary(Counter({"mlu": 2, "gpu": 1})) == (
        "deselected 3 tests that need hardware absent here: 1 need a GPU, 2 need an MLU")
