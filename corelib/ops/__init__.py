"""The ops a model calls: a plain-torch reference for each, replaceable op by op by a backend.

``reference_ops()`` (:mod:`corelib.ops.reference`) is the fallback on every backend (the cpu
backend and the stream emulator use nothing else). A backend that accelerates some ops hands
an :class:`OpProvider` to the engine; the ``fused_ops`` gate decides whether it is used, and
``Ops.with_provider`` swaps in the provider's ops while the rest stay on the reference.
"""

from corelib.ops.composed import NONFINITE, fold_norm_weight
from corelib.ops.spec import (
    COMPOSED_OPS,
    OP_NAMES,
    SAMPLING_COLUMNS,
    SAMPLING_TABLES,
    OpProvider,
    Ops,
    PagedAttention,
    SamplingColumn,
    SamplingInputs,
    TokenHistory,
    load_provider,
)

__all__ = [
    "COMPOSED_OPS",
    "NONFINITE",
    "OP_NAMES",
    "SAMPLING_COLUMNS",
    "SAMPLING_TABLES",
    "OpProvider",
    "Ops",
    "PagedAttention",
    "SamplingColumn",
    "SamplingInputs",
    "TokenHistory",
    "fold_norm_weight",
    "load_provider",
]
