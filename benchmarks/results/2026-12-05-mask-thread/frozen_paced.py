"""json_paced.py with the engine's startup heap frozen once it is built, in either tree (87abe4e did not freeze
it), and the collector's full passes counted. Run from a tree's benchmarks/ folder with that tree on PYTHONPATH."""

import gc
import sys
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, ".")
from corelib.engine.api import Engine

built: Any = Engine.from_overrides.__func__  # type: ignore[attr-defined]


def frozen(cls: type[Engine], overrides: Sequence[str] = ()) -> Engine:
    engine: Engine = built(cls, overrides)
    gc.collect()
    gc.freeze()
    return engine


Engine.from_overrides = classmethod(frozen)  # type: ignore[method-assign,assignment]
import json_paced  # noqa: E402

passes: list[int] = []
gc.callbacks.append(lambda phase, info: passes.append(1) if phase == "stop" and info["generation"] == 2 else None)
json_paced.main()
print(f"full collections in the process: {len(passes)}")
