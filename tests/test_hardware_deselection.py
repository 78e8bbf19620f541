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


CLOSE_MODULE = """
def test_close_finishes_queued_work_and_joins_every_thread(conformance_target):
    pass

def test_another_conformance_test(conformance_target):
    pass
"""


@pytest.mark.slow
def test_the_close_test_runs_as_many_more_times_as_asked(pytester: pytest.Pytester) -> None:
    # A race between close and a helper thread shows as one failure in many runs of the whole suite.
    pytester.makepyfile(test_close=CLOSE_MODULE)
    args = ["-p", "corelib.testing.plugin", "-p", "no:cacheprovider", "-n", "0", "--corelib-backend", "cpu"]
    once = pytester.runpytest_inprocess(*args).parseoutcomes()["passed"]
    again = pytester.runpytest_inprocess(*args, "--corelib-repeat-close", "3", "-v")
    targets = once // 2
    assert targets > 0
    again.assert_outcomes(passed=targets * 4 + targets)  # the close test 1 + 3 times, the other test once
    again.stdout.fnmatch_lines(["*test_close_finishes_queued_work_and_joins_every_thread*-run3]*PASSED*"])
