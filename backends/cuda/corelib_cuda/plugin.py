"""Entry point of the cuda plugin (group ``corelib.backends``)."""

from __future__ import annotations

from collections.abc import Sequence

from corelib.backend import Backend
from corelib.plugins import hookimpl
from corelib_cuda.backend import CUDABackend


@hookimpl
def corelib_backends() -> Sequence[Backend]:
    return [CUDABackend()]
