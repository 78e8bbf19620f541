"""Entry point of the npu plugin (group ``corelib.backends``)."""

from __future__ import annotations

from collections.abc import Sequence

from corelib.backend import Backend
from corelib.plugins import hookimpl
from corelib_npu.backend import NPUBackend


@hookimpl
def corelib_backends() -> Sequence[Backend]:
    return [NPUBackend()]
