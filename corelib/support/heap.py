"""The garbage collector around a long-lived engine's startup."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Move everything built so far out of the collector's sight: it lives as long as the process, and a full
    collection would otherwise walk it (some 200 k objects once an engine is up) between two steps or while a
    health check waits. vLLM's engine core does the same once it is up."""
    gc.collect()
    gc.freeze()


def thaw_startup_heap() -> None:
    """Give what was frozen back to the collector: an engine that closes leaves its objects to be collected
    (another engine of the process then runs with its startup heap in sight again, slower passes only)."""
    gc.unfreeze()
