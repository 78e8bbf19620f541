"""The backend conformance suite (what ``pytest -m gpu`` and a backend's own run collect) holds every op
conformance test: a test written in ``op_conformance`` and not exported would run only in Triton's interpreter."""

from __future__ import annotations

import corelib.testing.conformance as suite
import corelib.testing.op_conformance as ops


def test_the_conformance_suite_runs_every_op_conformance_test() -> None:
    written = {name for name in vars(ops) if name.startswith("test_") and callable(getattr(ops, name))}
    assert written, "op_conformance has no tests"
    assert sorted(name for name in written if getattr(suite, name, None) is not getattr(ops, name)) == []
