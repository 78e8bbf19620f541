"""The op conformance sweep in Triton's CPU interpreter runs on request only (``-m interpreter_sweep``).

The interpreter runs each kernel element by element in Python: the sweep over every geometry
takes about 20 minutes on two cores, while a GPU runs it natively in seconds (the backend
conformance suite, ``-m gpu``). The default cases of every op still run here by default.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name == "test_triton_ops.py" and item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.interpreter_sweep)
