"""Entry point of the cpu plugin (group ``corelib.backends``)."""

from __future__ import annotations

from collections.abc import Sequence

from corelib.backend import Backend
from corelib.plugins import hookimpl
from corelib_cpu.device import CpuBackend


@hookimpl
def corelib_backends() -> Sequence[Backend]:
    return [CpuBackend()]
